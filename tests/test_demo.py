import subprocess
import sys

import pytest

from flax_escale import create_mesh
from flax_escale.demo import describe_mesh, main


def test_describe_mesh():
    text = describe_mesh(create_mesh((1, -1, 1, 2, 1)))
    assert text.startswith("mesh dp=1 (Auto), fsdp=4 (Auto), ep=1 (Auto), tp=2 (Auto), sp=1 (Auto)")
    assert "on 8 cpu devices" in text


def test_main_prints_the_mesh(capsys):
    main(["--mesh", "dp:2,fsdp:-1,ep:1,tp:2,sp:1", "--axis-types", "explicit"])
    out = capsys.readouterr().out
    assert "mesh dp=2 (Explicit), fsdp=2 (Explicit), ep=1 (Explicit), tp=2 (Explicit)" in out


def test_main_rejects_a_bad_mesh():
    with pytest.raises(ValueError, match=r"unknown axis name 'model'"):
        main(["--mesh", "model:8"])


def test_module_runs_in_a_fresh_process():
    done = subprocess.run(
        [sys.executable, "-m", "flax_escale.demo"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert (
        "mesh dp=1 (Auto), fsdp=8 (Auto), ep=1 (Auto), tp=1 (Auto), sp=1 (Auto) on 8 cpu devices"
        in done.stdout
    )
