"A comparison's fits side by side on an executor: the serial comparison's numbers, run for run, and the parent alone saving them."
import json
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
import pytest, torch
from loss_filters.compare import compare_filters, load_comparison
from loss_filters.plan import fit_executor
from test_compare import tab_learner   # module-level: a process pool sends it to its workers by name

pytestmark = pytest.mark.tooling   # run once, in the first pass (conftest.py)

KW = dict(methods='baseline blf', epochs=2, lr=1e-2, seeds=2, budgets='.5 1.5', show_progress=False, warmup=False)

def _same_runs(a, b):
    "Every trained figure of every run equal, bit for bit (the times aside)"
    assert [(r['method'], r['seed']) for r in a] == [(r['method'], r['seed']) for r in b]
    for r, s in zip(a, b):
        for k in ('final_metric', 'trained', 'scored', 'work', 'kept', 'mean_samp_perc'): assert r[k] == s[k], (r['method'], r['seed'], k)
        assert [e['metric'] for e in r['history']] == [e['metric'] for e in s['history']]

@pytest.fixture(scope='module')
def serial():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as each worker sets itself
    try: return compare_filters(tab_learner, **KW)
    finally: torch.set_num_threads(threads)

def _readings(cmp) -> list:
    "Every reading of work and accuracy (not of seconds, which two runs of one comparison never share)"
    return [(r['method'], r.get('at_work'), r.get('vs_random'), r.get('vs_random_work'), r.get('vs_plain')) for r in cmp.rows]

def test_two_processes_give_the_serial_comparison_run_for_run(serial, tmp_path):
    assert {'baseline:epochs=1', 'baseline:epochs=3'} <= {r['method'] for r in serial.runs}
    assert any(r['method'].startswith('random_batch') for r in serial.runs)   # the control that needs the filter's kept share
    calls = []
    with fit_executor(2, threads=1) as ex:
        par = compare_filters(tab_learner, **KW, executor=ex, folder=tmp_path, on_run=lambda *a: calls.append(a))
    _same_runs(serial.runs, par.runs)
    assert par.control_of == serial.control_of and _readings(par) == _readings(serial)   # only the seconds differ
    saved = [json.loads(l) for l in (tmp_path / 'runs.jsonl').read_text().splitlines()]
    assert len(saved) == len(par.runs) == len(calls) and all(r['fit_s'] > 0 for r in saved)   # the parent wrote each run once
    # a comparison cut off after its methods resumes serially, training only what is missing
    (tmp_path / 'runs.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in saved if r['method'] in ('baseline', 'blf')))
    again = []
    resumed = compare_filters(tab_learner, **KW, folder=tmp_path, on_run=lambda *a: again.append(a[0]))
    assert again and not {'baseline', 'blf'} & set(again)
    _same_runs(serial.runs, resumed.runs)

class OwnFutures:
    "An executor whose futures are not `concurrent.futures` ones, as dask's and submitit's are not: only `done()` and `result()`"
    class Job:
        def __init__(self, fut): self._fut = fut
        def done(self): return self._fut.done()
        def result(self): return self._fut.result()
    def __init__(self): self.pool = fit_executor(2, threads=1)
    def submit(self, fn, *args, **kwargs): return self.Job(self.pool.submit(fn, *args, **kwargs))

def test_any_executor_with_submit_and_result(serial):
    ex = OwnFutures()
    try: _same_runs(serial.runs, compare_filters(tab_learner, **KW, executor=ex, threads=1).runs)
    finally: ex.pool.shutdown()

def test_threads_of_one_process_are_refused():
    "Fits in threads share torch's random state: their numbers would depend on timing"
    with ThreadPoolExecutor(2) as ex, pytest.raises(ValueError, match='`executor` runs fits in threads'):
        compare_filters(tab_learner, **KW, executor=ex)

def test_what_a_process_pool_cannot_send_is_refused_first():
    with ProcessPoolExecutor(1) as ex:
        with pytest.raises(TypeError, match='`make_learner` cannot be sent to the executor'):
            compare_filters(lambda: tab_learner(), **KW, executor=ex)
        with pytest.raises(TypeError, match='`check` cannot be sent'):
            compare_filters(tab_learner, **KW, executor=ex, check=lambda m, dl: 0.)

def test_each_worker_sets_its_own_threads():
    "N workers on N cores do not oversubscribe: each takes its share of the cores (or the threads asked for)"
    with fit_executor(2, threads=1) as ex: assert [ex.submit(torch.get_num_threads).result() for _ in range(2)] == [1, 1]
    with pytest.raises(ValueError, match='`jobs` must be an integer >= 1'): fit_executor(0)
