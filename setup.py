"Classic nbdev 2 `setup.py`: every piece of metadata comes from `settings.ini`."
from configparser import ConfigParser
import setuptools, shlex

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

for o in 'version description keywords author author_email lib_name user min_python license status'.split():
    assert o in cfg, f'missing expected setting: {o}'

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable',
            '6 - Mature', '7 - Inactive']
py_versions = '3.9 3.10 3.11 3.12 3.13'.split()
min_python = tuple(int(p) for p in cfg['min_python'].split('.'))
lic = licenses.get(cfg['license'].lower(), (cfg['license'], None))

requirements = shlex.split(cfg.get('requirements', ''))
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
extras = {'dev': dev_requirements}
for name in shlex.split(cfg.get('extras', '')): extras[name] = shlex.split(cfg.get(f'{name}_requirements', ''))
scripts = [s.strip() for s in cfg.get('console_scripts', '').split('\n') if s.strip()]

setuptools.setup(
    name=cfg['lib_name'].replace('_', '-'),
    version=cfg['version'],
    license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'Natural Language :: ' + cfg['language'].title()]
        + ['Programming Language :: Python :: ' + v for v in py_versions
           if tuple(int(p) for p in v.split('.')) >= min_python]
        + (['License :: ' + lic[1]] if lic[1] else []),
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=[cfg['lib_name'], cfg['lib_name'] + '.*']),
    include_package_data=True,
    install_requires=requirements,
    extras_require=extras,
    dependency_links=cfg.get('dep_links', '').split(),
    python_requires='>=' + cfg['min_python'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': scripts, 'nbdev': [f'{cfg["lib_path"]}={cfg["lib_path"]}._modidx:d']},
    **{k: cfg[k] for k in ('author', 'author_email', 'description', 'keywords')},
)
