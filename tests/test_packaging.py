"What the package ships: `python -m build` makes an sdist and, from it, a wheel (as pip builds one from PyPI), and `twine check` passes both."
import configparser, shutil, subprocess, sys, tarfile, zipfile
from pathlib import Path
import pytest

pytest.importorskip('build'); pytest.importorskip('twine')   # dev tools: `pip install build twine`
ROOT = Path(__file__).resolve().parents[1]
CFG = configparser.ConfigParser(delimiters=['=']); CFG.read(ROOT / 'settings.ini', encoding='utf-8'); CFG = CFG['DEFAULT']

def _source(dest:Path) -> Path:
    "The top-level files and the package, as a fresh clone holds them: the build sees none of this checkout's environments or build folders"
    for p in ROOT.iterdir():
        if p.is_file() and not p.name.startswith('.'): shutil.copy2(p, dest / p.name)
    shutil.copytree(ROOT / CFG['lib_path'], dest / CFG['lib_path'], ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
    return dest

def _run(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, '-m', *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)

@pytest.fixture(scope='module')
def dist(tmp_path_factory):
    "`(result of python -m build, its output folder)`: no isolation, so no download; the wheel is built from the sdist"
    src, out = _source(tmp_path_factory.mktemp('src')), tmp_path_factory.mktemp('dist')
    return _run('build', '--no-isolation', '--outdir', str(out), str(src)), out

def _one(out:Path, pattern:str) -> Path:
    found = sorted(out.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {out}, found {[p.name for p in found]}"
    return found[0]

def test_build_makes_an_sdist_and_a_wheel(dist):
    r, out = dist
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    name = f"{CFG['lib_name']}-{CFG['version']}"
    _one(out, f'{name}.tar.gz'); _one(out, f'{name}-py3-none-any.whl')

def test_the_sdist_holds_what_setup_py_reads(dist):
    r, out = dist
    if r.returncode: pytest.skip('no sdist: see test_build_makes_an_sdist_and_a_wheel')
    with tarfile.open(_one(out, '*.tar.gz')) as t: names = {n.split('/', 1)[-1] for n in t.getnames()}
    assert {'setup.py', 'settings.ini', 'README.md', f"{CFG['lib_path']}/core.py"} <= names

def test_the_wheel_holds_the_package_its_entry_points_and_unpinned_requirements(dist):
    r, out = dist
    if r.returncode: pytest.skip('no wheel: see test_build_makes_an_sdist_and_a_wheel')
    with zipfile.ZipFile(_one(out, '*.whl')) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith('.dist-info/METADATA'))
        meta = z.read(info).decode()
        entry = z.read(info.replace('METADATA', 'entry_points.txt')).decode()
    lib = CFG['lib_path']
    assert {f'{lib}/__init__.py', f'{lib}/core.py', f'{lib}/base.py', f'{lib}/_modidx.py'} <= names
    assert not any('__pycache__' in n or n.startswith(('tests/', 'nbs/')) for n in names)
    assert 'lf_bench = loss_filters.bench:main' in entry and f'{lib} = {lib}._modidx:d' in entry   # the command and nbdev's index
    assert 'Requires-Dist: fastai>=2.7' in meta and 'Requires-Dist: fastai<' not in meta                  # fastai is not pinned

def test_twine_check_passes(dist):
    r, out = dist
    if r.returncode: pytest.skip('nothing to check: see test_build_makes_an_sdist_and_a_wheel')
    files = [str(p) for p in sorted(out.iterdir())]
    t = _run('twine', 'check', '--strict', *files)
    assert t.returncode == 0 and t.stdout.count('PASSED') == len(files) == 2, f"twine check failed:\n{t.stdout}\n{t.stderr}"

def test_the_github_workflows_are_nbdevs():
    "`.github/workflows` as `nbdev_new` makes it: nbdev's CI on every push and pull request, the docs deployed from main"
    yaml = pytest.importorskip('yaml')
    wf = {n: yaml.safe_load((ROOT / '.github/workflows' / f'{n}.yaml').read_text()) for n in ('test', 'deploy')}
    uses = lambda w: [s.get('uses', '') for j in w['jobs'].values() for s in j['steps']]
    assert 'fastai/workflows/nbdev-ci@master' in uses(wf['test']) and set(wf['test'][True]) >= {'push', 'pull_request'}   # YAML reads `on` as True
    assert uses(wf['deploy']) == ['fastai/workflows/quarto-ghp@master'] and wf['deploy']['permissions'] == {'contents': 'write', 'pages': 'write'}

def test_importing_the_package_leaves_the_users_warning_filters_alone():
    "A library must not change its users' warning filters: `loss_filters.bench` quiets a dependency's import warning only while it imports"
    import subprocess, sys
    code = ("import warnings\n"
            "import loss_filters.all, loss_filters.bench, loss_filters.compare\n"
            "left = [f for f in warnings.filters if f[1] is not None and 'jit\\\\.script' in f[1].pattern]\n"
            "assert not left, left")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
