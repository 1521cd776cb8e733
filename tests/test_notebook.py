"""examples/api_quickstart.ipynb runs end to end in a real Jupyter kernel (nbclient, ipykernel; issue 46's
acceptance): it runs an experiment through shuffledp.api (real services), shows the DataFrame and a plot, and
predicts with the released model. The assertions read the executed notebook's outputs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "api_quickstart.ipynb"


def test_the_example_notebook_runs_in_a_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel of this interpreter (ipykernel's native one), working in tmp_path (results/ is written there)
    client = NotebookClient(
        nb, timeout=240, kernel_name=NATIVE_KERNEL_NAME, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors

    def text(cell) -> str:
        parts = []
        for o in cell.outputs:
            if o.output_type == "stream":
                parts.append(o.text)
            elif "text/plain" in o.get("data", {}):
                parts.append(o["data"]["text/plain"])
        return "".join(parts)

    run, frame, plot, predict, spend = code
    # the experiment: the command's progress lines, streamed, and the Result
    shown = text(run)
    assert re.search(r"round +4/4 +contributors +1348", shown), shown
    assert "state: COMPLETED" in shown and "privacy spent: eps = " in shown
    assert "Result(run_id=" in shown and "state='COMPLETED'" in shown
    # the DataFrame, rendered as a table
    html = frame.outputs[0]["data"]["text/html"]
    assert "<table" in html and "eps_spent" in html and html.count("<tr>") >= 5  # header + 4 rounds
    # the plot
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    # predictions agree with the analyzer's accuracy of the released model
    m = re.search(r"accuracy of predict: ([\d.]+); the run's: ([\d.]+)", text(predict))
    assert m and m.group(1) == m.group(2) and float(m.group(1)) > 0.5, text(predict)
    assert "Spend(eps=" in text(spend) and "trust_model='SHUFFLE'" in text(spend)
    assert sys.executable  # the kernel ran this interpreter's ipykernel (NATIVE_KERNEL_NAME)
    assert list((tmp_path / "results").glob("default-*/summary.json"))
