"""Maps the repository's folders under one import root, ``lorastream``.

The folders stay where a reader looks for them (``services/adapter_store/``,
``services/gpu_worker/``, ``gateway/``, ``kernels/``); the wheel installs them as subpackages of
``lorastream`` and nothing else at the top level of site-packages. Everything else about the
package is declared in pyproject.toml.
"""

from setuptools import find_packages, setup

# import name -> folder in the repository
PACKAGE_DIRS = {
    "lorastream": "lorastream",
    "lorastream.store": "services/adapter_store",
    "lorastream.worker": "services/gpu_worker",
    "lorastream.gateway": "gateway",
    "lorastream.kernels": "kernels",
}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIRS.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


setup(package_dir=PACKAGE_DIRS, packages=packages())
