"""The packages' public names, imported on first use (nasd_core/lazy.py)."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_an_export_stays_itself_when_its_namesake_submodule_is_imported_first():
    # nasd_core.compat imports the submodule nasd_core.generate before anyone asks for the function.
    code = "import nasd_core.compat\nfrom nasd_core import generate\nprint(callable(generate))"
    assert run_python(code).split() == ["True"]


def test_the_pool_cli_and_the_configs_load_no_torch():
    code = (
        "import sys, pool_service.__main__\nfrom nasd_core import SamplingParams\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    assert run_python(code).split() == ["False", "False"]


def test_every_export_resolves_and_an_unknown_name_is_an_attribute_error():
    import nasd_core
    import pool_service

    for package in (nasd_core, pool_service):
        assert all(getattr(package, name) is not None for name in package.__all__)
        assert set(package.__all__) <= set(dir(package))
        try:
            package.no_such_name  # noqa: B018
        except AttributeError as error:
            assert "no_such_name" in str(error)
        else:
            raise AssertionError("an unknown name resolved")
