"The package's floors: the judge without torch, and the spec language's data pinned to the callbacks it names"
import inspect, subprocess, sys
from pathlib import Path
import pytest
from loss_filters.methods import METHODS, SETTINGS, BATCH, judged_method, parse_method

NBS = Path(__file__).resolve().parent.parent / 'nbs'
JUDGE = ('checks', 'methods', 'records', 'rules', 'stats', 'verdicts', 'report', 'plots', 'comparison')

def test_the_judge_and_saved_runs_need_neither_torch_nor_fastai():
    code = (f"import sys\nfor m in {JUDGE!r}: __import__('loss_filters.' + m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastai')))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == '[]', out

@pytest.mark.parametrize('name', sorted(SETTINGS))
def test_settings_are_the_callbacks_own(name):
    "`SETTINGS` lets the judge read a method without its class: it must be exactly what the class takes, with its defaults"
    cls = parse_method(name).cls
    sig = {k: p.default for k, p in inspect.signature(cls).parameters.items() if k not in ('self', 'args', 'kwargs')}
    assert SETTINGS[name] == sig
    from loss_filters.batch import LossFilterCallback
    assert (name in BATCH) == issubclass(cls, LossFilterCallback)

SPECS = ['blf', 'blf_gn', 'sb', 'sb:start=.2,interrupt=0', 'topk:fill_batch=True', 'random_batch:keep=.3,skip_epochs=1', 'stale',
         'stale:anneal=0,lr_scale=True', 'hide', 'hide:lr_scale=False', 'drop', 'random', 'random:from_first=True,lr_scale=True']

@pytest.mark.parametrize('spec', SPECS)
def test_what_the_rules_read_matches_the_built_callback(spec):
    "The settings the control rules copy, read without the class, are those of the callback built from the spec"
    m = parse_method(spec)
    cb = m.cls(**m.kw)
    keys = ('start', 'end', 'interrupt', 'skip_epochs', 'fill_batch') if m.batch else ('anneal', 'lr_scale')
    assert {k: judged_method(spec).setting(k) for k in keys} == {k: getattr(cb, k) for k in keys}
    if not m.batch: assert judged_method(spec).prunes_first == cb.prunes_first

def test_every_method_name_parses_and_judges_alike():
    for name in METHODS:
        a, b = parse_method(name), judged_method(name)
        assert (a.plain, a.batch, a.chooses, dict(a.kw)) == (b.plain, b.batch, b.chooses, dict(b.kw))

def _modules():
    from pathlib import Path
    import loss_filters
    return sorted(p for p in Path(loss_filters.__file__).parent.glob('*.py') if p.name != '_modidx.py')

def test_classes_read_on_a_screen_or_two():
    "No class passes 150 lines: a class of several concerns is split into collaborators or mixins"
    import ast
    long = [f"{p.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for p in _modules() for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 150]
    assert not long, long

def test_lines_and_docstrings_are_short():
    "Lines within 150 characters, and docstrings of a sentence (at most 130 characters), the detail in the notebooks' prose"
    import ast
    wide = [f"{p.name}:{i}" for p in _modules() for i, l in enumerate(p.read_text().splitlines(), 1) if len(l) > 150]
    assert not wide, wide
    docs = [f"{p.name}:{getattr(n, 'name', 'module')}" for p in _modules() for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and len(ast.get_docstring(n) or "") > 130]
    assert not docs, docs

def test_no_side_effects_on_the_users_session(tmp_path):
    "Saving a comparison leaves the user's matplotlib backend as it was, and importing the bench leaves the warnings filters as they were"
    code = ("import matplotlib, warnings; matplotlib.use('svg'); before = list(warnings.filters)\n"
            "import loss_filters.bench\n"
            "from loss_filters.comparison import load_comparison\n"
            f"load_comparison({str(NBS / 'bench_runs' / 'noisy_noisy20_runs.jsonl.gz')!r}).save({str(tmp_path)!r})\n"
            "print(matplotlib.get_backend(), warnings.filters == before)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ['svg', 'True'], out
    assert (tmp_path / 'accuracy_vs_budget.png').stat().st_size > 0
