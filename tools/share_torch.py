"""Hard-link torch and its compiled companions from one virtual environment into another.

`make test` builds two environments, the pinned one and one with the newest fastai. Both get the same torch release (the
newest one pip may install), and with its CUDA libraries that release is about 5 GB: linked instead of installed twice, the
second environment costs only what differs. pip then finds these distributions installed and leaves them, unless a newer
release is allowed, which it installs in the second environment alone (a link removed there leaves the first one whole).

    python tools/share_torch.py FROM_PYTHON TO_PYTHON

Only files inside site-packages are linked (a console script names its own environment's interpreter); a file already in the
target is left as it is. Where links can't be made (another file system), nothing is lost: pip installs as before.
"""
import json, os, re, subprocess, sys
from pathlib import Path

ROOTS = ('torch', 'torchvision', 'triton')   # and every requirement of theirs that ships CUDA libraries
HEAVY = re.compile(r'^(nvidia|cuda)[-_]', re.I)

def env_info(python):
    "site-packages of the environment `python` runs, and each installed distribution's files and requirements there."
    code = r'''
import json, sysconfig
from importlib.metadata import distributions
site = sysconfig.get_path('purelib')
out = {}
for d in distributions():
    if d.files is None or not str(d.locate_file('')).startswith(site): continue
    out[d.metadata['Name'].lower().replace('_', '-')] = dict(files=[str(f) for f in d.files], requires=d.requires or [])
print(json.dumps(dict(site=site, dists=out)))
'''
    return json.loads(subprocess.run([python, '-c', code], check=True, capture_output=True, text=True).stdout)

def req_name(req):
    "The distribution a requirement line names: 'nvidia-cublas==13.1; platform_system == \"Linux\"' -> 'nvidia-cublas'."
    return re.match(r'\s*([A-Za-z0-9._-]+)', req).group(1).lower().replace('_', '-')

def to_share(dists, roots=ROOTS):
    "`roots` found in `dists`, with every requirement of theirs (recursively) whose name says it ships CUDA libraries."
    todo, seen = [r for r in roots if r in dists], set()
    while todo:
        name = todo.pop()
        if name in seen: continue
        seen.add(name)
        todo += [n for n in map(req_name, dists[name]['requires']) if n in dists and HEAVY.match(n)]
    return sorted(seen)

def link_files(src_site, dst_site, files):
    """Hard-link each of `files` (relative to `src_site`, inside it) into `dst_site`; the number linked. The metadata goes last:
    pip sees a distribution installed only once all its files are there."""
    src_site, dst_site, n = Path(src_site).resolve(), Path(dst_site), 0
    for f in sorted(files, key=lambda f: '.dist-info/' in f.replace(os.sep, '/')):
        src = (src_site/f).resolve()
        if src_site not in src.parents or not src.is_file(): continue   # a console script in bin/, or gone
        dst = dst_site/src.relative_to(src_site)
        if dst.exists(): continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
        n += 1
    return n

def share(src_python, dst_python, roots=ROOTS):
    "Link `roots` and their CUDA companions from `src_python`'s environment into `dst_python`'s; the names linked."
    src, dst = env_info(src_python), env_info(dst_python)
    names = [n for n in to_share(src['dists'], roots) if n not in dst['dists']]
    for n in names: link_files(src['site'], dst['site'], src['dists'][n]['files'])
    return names

if __name__ == '__main__':
    if len(sys.argv) != 3: sys.exit(__doc__)
    try: names = share(*sys.argv[1:])
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f'share_torch: nothing shared ({e}); pip installs everything')
    print(f"share_torch: linked {len(names)} distributions ({', '.join(names) or 'none'})")
