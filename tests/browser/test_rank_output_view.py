"""The proposed per-rank view (utils/labkit/display.py) as a student sees it in JupyterLab: one
column per rank, wrapped 4 to a row, stderr in red, collapsible, updated live; plain labelled text
for headless readers.

    .venv/bin/pytest tests/browser/test_rank_output_view.py -v
"""
import pytest

from labkit.runtime.display import rank_outputs_bundle, rank_outputs_text

SIX_RANKS = ("from labkit.runtime.display import show_rank_outputs\n"
             "show_rank_outputs({r: [f'step {i} on rank {r}' for i in range(3)]\n"
             "                      + ([('err', 'a warning on rank 1')] if r == 1 else [])\n"
             "                   for r in range(6)})")
LIVE = ("import time\n"
        "from labkit.runtime.display import RankOutputView\n"
        "view = RankOutputView(min_interval=0.1)\n"
        "for i in range(3):\n"
        "    for r in range(2):\n"
        "        view.add(r, f'line {i} of rank {r}')\n"
        "    time.sleep(0.5)\n"
        "view.close()")


def test_text_version_is_grouped_by_rank():
    """Headless runs read text/plain: labelled lines, each rank's lines together, ranks in order."""
    lines = {1: ["b1", ("err", "b2")], 0: ["a1", "a2"]}
    assert rank_outputs_text(lines) == "[rank 0] a1\n[rank 0] a2\n[rank 1] b1\n[rank 1] b2"
    assert rank_outputs_text({r: ["x"] for r in range(11)}).splitlines()[0] == "[rank  0] x"
    bundle = rank_outputs_bundle(lines)
    assert set(bundle) == {"text/plain", "text/html"} and 'data-rank="1"' in bundle["text/html"]


@pytest.mark.browser
@pytest.mark.timeout(60)
def test_ranks_side_by_side_in_lab(nb, shot, scratch_notebook):
    nb.open(scratch_notebook("rank_view", [SIX_RANKS, LIVE]))
    nb.run_cell(0)
    nb.wait_executed(30, cells=[0])
    cell = nb.code_cell(0)
    headers = cell.locator(".labkit-rank-outputs th").all_inner_texts()
    assert headers == [f"rank {r}" for r in range(6)], headers
    assert cell.locator(".labkit-rank-outputs tr").count() == 4, "6 ranks: 4 columns, then 2"
    lines = nb.rank_lines(0)
    assert lines[0] == [f"step {i} on rank 0" for i in range(3)], lines
    assert lines[1][-1] == "a warning on rank 1", lines
    red = cell.locator("td[data-rank='1'] span").evaluate("s => getComputedStyle(s).color")
    assert red == "rgb(204, 0, 0)", f"a rank's stderr line should be red, it is {red}"
    shot("six-ranks", cell)

    cell.locator(".labkit-rank-outputs summary").click()          # collapse
    assert not cell.locator(".labkit-rank-outputs table").is_visible()
    cell.locator(".labkit-rank-outputs summary").click()          # and open again
    assert cell.locator(".labkit-rank-outputs table").is_visible()

    nb.run_cell(1)
    nb.wait_running(1)
    live = nb.code_cell(1).locator("td[data-rank='1']")
    live.wait_for(timeout=5000)                                    # shown before the cell ends
    assert nb.prompts()[1].strip() == "[*]:", "the view should appear while the cell still runs"
    nb.wait_executed(15, cells=[1])
    assert nb.rank_lines(1) == {r: [f"line {i} of rank {r}" for i in range(3)] for r in range(2)}
    shot("live-done", nb.code_cell(1))
