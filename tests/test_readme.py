"""Every code block of README.md works as written.

- The `python` blocks of the "Use" section run in order, as one user would type them, in one fresh process.
- A `python` block that starts with `# name.py` is a script: it is written to that file and run with `python name.py`
  (one that trains on CIFAR10 on a tiny CIFAR10-shaped folder where `untar_data` finds it, offline; a comparison prints its verdicts).
- Any other `python` block runs on its own, in a fresh process.
- A bare block is the printed output of the python block before it: its fit-table header must be what that code prints.
- `sh` blocks: every command they name must exist (`make -n <target>`, `lf_bench --help`, the launchers, the extras).
A block of any other kind fails the test, so no block of the README goes unchecked.
"""
import configparser, math, os, re, shlex, shutil, subprocess, sys, tempfile
from pathlib import Path
import pytest

pytestmark = pytest.mark.tooling   # run once, in the first pass (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
BIN = Path(sys.executable).parent
USE = 'Use'   # the section whose python blocks are one session

def readme_blocks(text:str) -> list:
    "`(section, lang, code)` of every fenced block, in order; `section` is the `## ` heading above it"
    blocks, section, lines, i = [], '', text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith('```'):
            lang, j = line[3:].strip(), i + 1
            while j < len(lines) and lines[j].strip() != '```': j += 1
            assert j < len(lines), f"README.md: the block opened at line {i + 1} is never closed"
            blocks.append((section, lang, '\n'.join(lines[i + 1:j]) + '\n'))
            i = j + 1
            continue
        if line.startswith('## '): section = line[3:].strip()
        i += 1
    return blocks

BLOCKS = readme_blocks(README.read_text())

def script_name(code:str):
    "`name.py` when the block's first line is `# name.py`"
    m = re.match(r'#\s*([\w.-]+\.py)\s*$', code.splitlines()[0])
    return m.group(1) if m else None

def kind(i:int) -> str:
    "Which check covers block `i`: 'session', 'script', 'python', 'output', 'sh', or 'unchecked'"
    section, lang, code = BLOCKS[i]
    if lang == 'python': return 'script' if script_name(code) else 'session' if section == USE else 'python'
    if lang == 'sh': return 'sh'
    if lang == '' and i > 0 and BLOCKS[i - 1][1] == 'python' and BLOCKS[i - 1][0] == section: return 'output'
    return 'unchecked'

def of_kind(k:str) -> list: return [b for i, b in enumerate(BLOCKS) if kind(i) == k]

def run(args:list, cwd:Path, timeout:int=300, **env) -> subprocess.CompletedProcess:
    "Run `args` with this repository first on the path, fastai's folders under `cwd`, and any network access failing fast"
    e = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])]),
         'FASTAI_HOME': str(cwd / 'fastai_home'), 'HTTP_PROXY': 'http://127.0.0.1:9', 'HTTPS_PROXY': 'http://127.0.0.1:9',
         'http_proxy': 'http://127.0.0.1:9', 'https_proxy': 'http://127.0.0.1:9',
         # one compute thread: on cores shared with other jobs, torch's threads spin-waiting for each other cost 5x the CPU
         'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', **env}
    return subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)

def check_ok(r:subprocess.CompletedProcess, what:str):
    assert r.returncode == 0, f"{what} exited with {r.returncode}.\nstdout ends:\n{r.stdout[-1500:]}\nstderr ends:\n{r.stderr[-3000:]}"

def fit_tables(out:str) -> list:
    "The fit tables a console fit prints, as `(header, rows)` of tokens, progress bars left out"
    tables = []
    for seg in re.split(r'[\r\n]+', out):
        toks = seg.replace('█', ' ').split()
        if toks[:2] == ['epoch', 'train_loss']: tables.append((toks, [])); continue
        if not tables: continue
        n = len(tables[-1][0])
        row = toks[-n:]
        if len(row) == n and row[0].isdigit() and re.fullmatch(r'\d+:\d\d', row[-1]) and \
           all(re.fullmatch(r'-?[\d.]+(e-?\d+)?|nan|inf|#na#', t) for t in row[1:-1]): tables[-1][1].append(row)
    return tables

def test_every_block_is_checked():
    kinds = [kind(i) for i in range(len(BLOCKS))]
    unchecked = [BLOCKS[i][:2] for i, k in enumerate(kinds) if k == 'unchecked']
    assert not unchecked, f"README blocks no check covers (section, language): {unchecked}"
    for k in ('session', 'script', 'python', 'sh'): assert k in kinds, f"README.md has no {k} block: has the layout changed?"

def test_use_section_runs_as_one_session(tmp_path):
    "The Use blocks in order, in one process: every fit prints its table, with the filter's columns while a filter is on"
    code = ''.join(b[2] for b in of_kind('session'))
    (tmp_path / 'use.py').write_text(code)
    r = run([sys.executable, 'use.py'], tmp_path)
    check_ok(r, 'The README\'s "Use" blocks')
    tables = fit_tables(r.stdout + r.stderr)
    fits = re.findall(r'^[^#\n]*\bfit\w*\(', code, re.M)
    assert len(tables) == len(fits), f"{len(fits)} fits in the Use blocks, {len(tables)} fit tables printed"
    on = lambda at: max((m.end() for m in re.finditer(r'\.(batch_loss_filter|selective_backprop|top_loss|stale_loss_pruning|hide_learned)\(', code[:at])), default=-1) \
                    > max((m.end() for m in re.finditer(r'remove_cb\(learn\.loss_filter\)', code[:at])), default=-1)   # a filter added since the last removal
    filtered = [on(m.start()) for m in re.finditer(r'^[^#\n]*\bfit\w*\(', code, re.M)]
    for i, (header, rows) in enumerate(tables):
        cols = {'samp_perc', 'loss_perc', 'full_train_loss'}
        if filtered[i]: assert cols <= set(header), f"fit {i + 1} runs with a filter, but its table has no {cols}: {header}"
        else: assert not cols & set(header), f"fit {i + 1} runs after `remove_cb`, but its table has filter columns: {header}"
        assert rows, f"fit {i + 1} printed no rows"
        samp = [float(row[header.index('samp_perc')]) for row in rows] if 'samp_perc' in header else []
        assert all(0 <= s <= 1 for s in samp), samp
    # the printed output shown in the README is what the first fit prints: same columns, same epochs
    shown = of_kind('output')
    assert shown, "the Use section shows no fit table"
    want = fit_tables(shown[0][2])
    assert want, "the output block after the first Use block is not a fit table"
    (want_header, want_rows), (header, rows) = want[0], tables[0]
    assert header == want_header, f"README shows the columns {want_header}, the code prints {header}"
    assert [w[0] for w in want_rows] == [row[0] for row in rows]
    assert rows[0][header.index('samp_perc')] == want_rows[0][want_header.index('samp_perc')]   # the unfiltered first epoch

def test_scripts_run_as_written(tmp_path):
    "`# name.py` blocks run with `python name.py`; the CIFAR10 that `untar_data(URLs.CIFAR)` asks for is a tiny local copy"
    from loss_filters.data import make_cifar_like
    for _, _, code in of_kind('script'):
        name = script_name(code)
        (tmp_path / name).write_text(code)
        if 'URLs.CIFAR' in code:   # fastai's data folder under FASTAI_HOME, where `untar_data` looks before downloading
            bs = max(map(int, re.findall(r'\bbs=(\d+)', code)), default=64)
            cifar = make_cifar_like(tmp_path / 'fastai_home' / 'data' / 'cifar10', n_per_class=math.ceil(bs / 10) + 1, size=32)
            for png in cifar.glob('test/*/*.png'):   # one full training batch, and a validation image per class
                if png.stem != '0': png.unlink()
        r = run([sys.executable, name], tmp_path)
        check_ok(r, f"python {name}")
        if 'compare_filters' in code:   # a comparison: its table of verdicts, one row a method, and what the README shows of it
            out = r.stdout[r.stdout.index('method  verdict'):]
            assert out.splitlines()[1].split()[0] == 'blf', f"{name} printed no verdict for blf:\n{out}"
            if (want := shown_after(code)) is not None: assert shows_start(r.stdout, want), f"python {name} prints otherwise now:\n{r.stdout}"
            continue
        tables = fit_tables(r.stdout + r.stderr)
        assert tables and 'samp_perc' in tables[0][0], f"{name} printed no fit table with the filter's columns"

def shape(out:str) -> list:
    "A printout's shape: its paragraphs, each by its first two words with every number masked (the numbers, and seconds, differ by machine)"
    paras = [p for p in re.split(r'\n\s*\n', out.strip()) if p.strip()]
    mask = lambda w: re.sub(r'[-+≥≤]?\d[\d.,]*', '#', w)
    return [' '.join(mask(w) for w in p.split()[:2]) for p in paras]

def shows_start(out:str, shown:str) -> bool:
    "Whether the README's `shown` output is the start of `out`, paragraph by paragraph (at least two: the head and the table)"
    want = shape(shown)
    return len(want) >= 2 and shape(out)[:len(want)] == want

def shown_after(code:str) -> str|None:
    "The printed output the README shows right after the python block `code`, if any"
    i = next(i for i, b in enumerate(BLOCKS) if b[2] == code)
    return BLOCKS[i + 1][2] if i + 1 < len(BLOCKS) and kind(i + 1) == 'output' else None

def test_other_python_blocks_run(tmp_path):
    "Each runs on its own; where the README shows what it prints, it prints that today: the same paragraphs, each opening alike"
    for i, (_, _, code) in enumerate(of_kind('python')):
        (tmp_path / f'block{i}.py').write_text(code)
        r = run([sys.executable, f'block{i}.py'], tmp_path)
        check_ok(r, f"README python block {i + 1} outside Use\n{code}")
        if (want := shown_after(code)) is not None: assert shows_start(r.stdout, want), f"README python block {i + 1} prints otherwise now:\n{r.stdout}"

@pytest.fixture(scope='module')
def lf_bench_help(tmp_path_factory):
    exe = BIN / 'lf_bench'
    assert exe.is_file(), f"no `lf_bench` console script next to {sys.executable}: `pip install -e .` first"
    r = run([str(exe), '--help'], tmp_path_factory.mktemp('help'), timeout=120)
    check_ok(r, 'lf_bench --help')
    return r.stdout

def sh_commands(code:str) -> list:
    "The commands of an `sh` block, also those a comment offers as an alternative (`# or: ...`)"
    cmds = []
    for line in code.splitlines():
        cmd, _, comment = line.partition('#')
        cmds += [cmd.strip()] if cmd.strip() else []
        cmds += [alt.strip() for alt in re.findall(r'\bor:\s*(.+)$', comment)]
    return cmds

def check_command(cmd:str, lf_help:str):
    words = shlex.split(cmd)
    cfg = configparser.ConfigParser(); cfg.read(ROOT / 'settings.ini')
    if words[:3] == ['pip', 'install', '-e']:
        m = re.fullmatch(r'\.(?:\[([\w,]+)\])?', words[3])
        assert m and (ROOT / 'setup.py').is_file(), f"`{cmd}`: installs the clone, which needs setup.py"
        extras = cfg['DEFAULT'].get('extras', '').split()
        for extra in filter(None, (m.group(1) or '').split(',')): assert extra in extras, f"`{cmd}`: no extra {extra!r} in settings.ini"
    elif words[0] == 'make':
        assert shutil.which('make'), "`make` is not installed"
        # A recipe line that calls $(MAKE) runs even under -n: `make test`'s background build still opens its log, so that log
        # (which `make test` prints when the build fails) is sent elsewhere here, not truncated under a build in progress.
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run(['make', '-n', *words[1:], f'VENV_LATEST={tmp}/.venv-latest'], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, f"`make -n {' '.join(words[1:])}` fails:\n{r.stderr}"
    elif words[0] == 'lf_bench':
        for opt in (w for w in words if w.startswith('--')): assert opt in lf_help, f"`{cmd}`: lf_bench has no option {opt}"
    elif words[0] in ('accelerate', 'torchrun'):
        assert (BIN / words[0]).is_file() or shutil.which(words[0]), f"`{cmd}`: {words[0]} is not installed"
        assert words[-1] in {script_name(b[2]) for b in of_kind('script')}, f"`{cmd}`: the README shows no {words[-1]}"
    else: pytest.fail(f"no check for the README command `{cmd}`: add one to tests/test_readme.py")

def test_shell_commands_exist(lf_bench_help):
    cmds = [c for _, _, code in of_kind('sh') for c in sh_commands(code)]
    assert {'make bench', 'make test'} <= set(cmds), cmds
    for cmd in cmds: check_command(cmd, lf_bench_help)

def test_install_names_the_requirements():
    "The install block says what `pip install -e .` pulls in: settings.ini's requirements"
    cfg = configparser.ConfigParser(); cfg.read(ROOT / 'settings.ini')
    install = next(code for section, lang, code in BLOCKS if section == 'Install' and lang == 'sh')
    for req in cfg['DEFAULT']['requirements'].split(): assert req in install, f"the install block does not name {req}"

def test_bench_options_in_the_text_exist(lf_bench_help):
    "Inline `lf_bench ...` and `BENCH_ARGS='...'` in the README name only options lf_bench has"
    spans = re.findall(r'`([^`\n]+)`', README.read_text())
    opts = {o for s in spans if s.startswith('lf_bench') or 'BENCH_ARGS' in s for o in re.findall(r'(?<![\w-])--[\w-]+', s)}
    assert opts, "the README names no lf_bench option"
    spelled = lambda t: t.replace('_', '-')   # the script takes `--n_train` and `--n-train`; its help shows one, by fastcore version
    missing = sorted(o for o in opts if spelled(o) not in spelled(lf_bench_help))
    assert not missing, f"the README names lf_bench options it does not have: {missing}"
