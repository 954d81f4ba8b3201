"""The benchmark page is a reading of saved runs by today's code: run again, its printed numbers and words are what the page shows."""
import json, os, subprocess, sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.tooling   # run once, in the first pass (conftest.py)

NBS = Path(__file__).resolve().parent.parent / 'nbs'

def printed(nb:dict) -> list:
    "What each code cell printed or showed (stdout and results; a dependency's warnings on stderr left out)"
    out = []
    for c in nb['cells']:
        if c['cell_type'] != 'code': continue
        t = ''
        for o in c.get('outputs', []):
            if o.get('output_type') == 'stream' and o.get('name') == 'stdout': t += ''.join(o['text'])
            elif 'data' in o and 'text/plain' in o['data']: t += ''.join(o['data']['text/plain'])
        out.append(t)
    return out

def test_the_benchmark_page_regenerates_identical(tmp_path):
    "Every saved comparison judged again by today's code prints what `nbs/benchmarks.ipynb` (and so BENCHMARKS.md) shows, to the last digit"
    dest = tmp_path / 'benchmarks.ipynb'
    code = ("from execnb.shell import CaptureShell; import sys; "
            f"CaptureShell().execute('benchmarks.ipynb', {str(dest)!r}, exc_stop=True)")
    subprocess.run([sys.executable, '-c', code], cwd=NBS, check=True, env=os.environ | dict(OMP_NUM_THREADS='1'))
    want, got = printed(json.loads((NBS / 'benchmarks.ipynb').read_text())), printed(json.loads(dest.read_text()))
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.splitlines() == g.splitlines(), f"code cell {i} of the benchmark page prints otherwise now"
