"""notebooks/quickstart.ipynb runs top to bottom (nbclient + ipykernel, tiny settings)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("JGRPO_NOTEBOOK_STEPS", "3")  # CI size; the notebook default is 40
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    final = tmp_path / "runs" / "quickstart" / "final"
    assert (final / "config.json").is_file()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs
    )  # the curves were drawn inline
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "trained model:" in text and "3+4=" in text
