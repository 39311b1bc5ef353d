"""The Python API example of docs/python_api.md runs as written."""
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "python_api.md"


def test_python_api_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    torch.manual_seed(0)
    exec(compile(code, str(DOC), "exec"), {"__name__": "python_api_example"})
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["torch.Size([2, 2])", "[torch.Size([3]), torch.Size([5])] torch.Size([2, 4, 6, 6])"]
