"Write README.md from nbs/index.ipynb: markdown cells as they are, code cells as python blocks, text outputs and images kept."
import json, sys
from pathlib import Path

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
    md = nb_to_markdown(root / 'nbs' / 'index.ipynb')
    if sys.argv[1:] == ['--check']:
        if (root / 'README.md').read_text() != md: sys.exit('README.md is out of date: run `python tools/readme.py`')
    else: (root / 'README.md').write_text(md)
