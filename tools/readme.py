"""Write README.md from nbs/index.ipynb and BENCHMARKS.md from nbs/benchmarks.ipynb: markdown cells as they are,
code cells as python blocks, text outputs and images kept. `--check` fails when either file is out of date."""
import json, sys
from pathlib import Path

PAGES = {'README.md': 'index.ipynb', 'BENCHMARKS.md': 'benchmarks.ipynb'}   # page at the repo root: its notebook in nbs/

def nb_to_markdown(nb_path):
    parts = []
    for cell in json.loads(Path(nb_path).read_text())['cells']:
        src = ''.join(cell['source']).strip()
        if not src or src.startswith('#| hide') or src.startswith('#|hide'): continue
        if cell['cell_type'] == 'markdown': parts.append(src); continue
        parts.append('```python\n' + '\n'.join(l for l in src.splitlines() if not l.startswith('#|')) + '\n```')
        for out in cell.get('outputs', []):
            text = out.get('text') or out.get('data', {}).get('text/plain')
            if text: parts.append('```\n' + ''.join(text).rstrip() + '\n```')
    return '\n\n'.join(parts) + '\n'

if __name__ == '__main__':
    root = Path(__file__).resolve().parent.parent
    check = sys.argv[1:] == ['--check']
    stale = []
    for page, nb in PAGES.items():
        md = nb_to_markdown(root / 'nbs' / nb)
        if not check: (root / page).write_text(md)
        elif not (root / page).is_file() or (root / page).read_text() != md: stale.append(page)
    if stale: sys.exit(f"{' and '.join(stale)} out of date: run `python tools/readme.py`")
