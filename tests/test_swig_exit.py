"""A SWIG module first imported inside a test must not crash the run as the interpreter exits.

CI of stop 50 ended "Segmentation fault" after its summary (a core here: ``_PyObject_New(tp=0x0)``
in ``capsule_dealloc`` of ``sentencepiece._sentencepiece``, in ``finalize_modules``). sentencepiece
0.2.1 (SWIG 4.3; vLLM and SGLang import it) warns as it makes its types (DeprecationWarning: no
``__module__``); under the suite's ``error`` filter the type is NULL, and objects made later crash
the exit. Upstream: google/sentencepiece#1145. The suite's filters (pyproject.toml) ignore those
three warnings; this runs a test under them, in its own pytest, and checks the process's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FIRST_IMPORT = '''
def test_first_import_under_the_run_s_filters():
    import sentencepiece as spm

    spm.SentencePieceProcessor()
'''


def test_sentencepiece_first_imported_in_a_test_lets_the_process_exit(tmp_path: Path) -> None:
    pytest.importorskip("sentencepiece", reason="make engines installs it (with vLLM and SGLang)")
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = "\n".join(f"    {entry}" for entry in options["filterwarnings"])
    (tmp_path / "pytest.ini").write_text(
        f"[pytest]\nasyncio_default_fixture_loop_scope = {options['asyncio_default_fixture_loop_scope']}\n"
        f"filterwarnings =\n{lines}\n"
    )
    (tmp_path / "test_case.py").write_text(FIRST_IMPORT)
    # No pytest-benchmark (the GPU host has it): its warning that xdist is loaded is an error here.
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark", "-q",
                           "test_case.py"],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "1 passed" in out, out
    assert done.returncode == 0, (done.returncode, out)  # -11: SIGSEGV as the interpreter ended
