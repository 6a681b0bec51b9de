"""The mesh-config notebooks run top to bottom (nbclient, 8 simulated CPU devices)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") in ("stream", "display_data") for o in outputs)


def test_there_are_four_notebooks():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_mesh_configuration",
        "02_codec_anatomy",
        "03_your_own_flax_loop",
        "04_flax_nnx_tensor_parallel",
    ]
