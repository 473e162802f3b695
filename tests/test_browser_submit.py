"""Submitting through the form in real Chromium: an invalid field is shown next to the field
with what was typed kept; fixed, the job is stored and the job page shows it start, live. The
same with a job's own code, uploaded through the form's file input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from playwright.sync_api import Page

from tests.browser_support import cancel_all, log_in, screenshot
from tests.code_support import RINGS, directory_files, tar_gz

pytestmark = [pytest.mark.slow, pytest.mark.browser]


GAP_ABOVE = """(selector) => {
  // The empty height between the element and the nearest field above it in the same column.
  const box = document.querySelector(selector).getBoundingClientRect();
  const above = [...document.querySelectorAll(".submit-form .grid2 > *")].map((e) => e.getBoundingClientRect())
    .filter((b) => b.bottom <= box.top && b.left < box.right && b.right > box.left);
  return box.top - Math.max(...above.map((b) => b.bottom));
}"""


SUBMIT = "button[type=submit] >> text=Submit"


def refused(page: Page, error: str) -> str:
    """Submits the form on `page`, which refuses it; returns the text it shows at `error`."""
    page.click(SUBMIT)
    shown = page.locator(error)
    shown.wait_for()
    return shown.inner_text()


def shows_it_training(page: Page) -> None:
    """Waits until the job page on `page` shows its job running, its log at step 0."""
    page.wait_for_selector("#job-state.state-running", timeout=60_000)
    page.wait_for_function(
        "() => document.querySelector('#log')?.textContent.includes('starting from step 0')", timeout=60_000
    )


def test_submit_with_an_error_then_fixed(browser_platform: Any, chromium: Any) -> None:
    page = log_in(chromium, browser_platform, "alice")
    page.click("nav >> text=Submit")
    # What to train is the form's first choice, your own code one of its
    # two answers (not an entry at the end of the workload list), and Priority follows the
    # field above it without a gap the height of the consistency modes.
    choice = page.locator(".submit-form > fieldset.source-choice")
    assert choice.locator("legend").inner_text() == "What to train"
    assert page.locator("input[name=source]").evaluate_all("rs => rs.map((r) => r.value)") == ["own-code", "catalogue"]
    assert page.locator("#source-catalogue").is_checked() and page.locator("#workload").is_visible()
    assert "own-code" not in page.locator("#workload option").evaluate_all("os => os.map((o) => o.value)")
    name_box, choice_box = page.locator("#name").bounding_box(), choice.bounding_box()
    assert name_box and choice_box and choice_box["y"] < name_box["y"], "the choice comes first"
    gap = page.evaluate(GAP_ABOVE, "#priority-choice")
    assert gap < 30, f"{gap:.0f} px of empty space above Priority"
    screenshot(page, "submit-form")
    page.fill("#name", "from-the-form")
    page.fill("#min_workers", "3")
    page.fill("#max_workers", "2")
    page.fill("#hp-digits-mlp-lr", "0.02")
    page.fill("#length", "100000")
    assert "must be at least min_workers (3)" in refused(page, "#max_workers-error")
    assert page.locator("#max_workers").get_attribute("aria-invalid") == "true"
    assert page.input_value("#name") == "from-the-form", "what was typed is kept"
    assert page.input_value("#hp-digits-mlp-lr") == "0.02"
    screenshot(page, "submit-error")

    page.fill("#min_workers", "1")
    page.click(SUBMIT)
    page.wait_for_url("**/jobs/*/")
    shows_it_training(page)
    screenshot(page, "job-page")
    cancel_all(browser_platform, "alice")


def test_yaml_paste(browser_platform: Any, chromium: Any) -> None:
    page = log_in(chromium, browser_platform, "alice")
    page.goto(browser_platform.base_url + "/jobs/new/")
    page.click("text=Or paste or upload the spec as YAML")
    page.fill("#spec_yaml", "name: yaml-job\nworkload: digits-cnn\nmin_workers: 1\nmax_workers: 1\nsteps: 5\nhyperparameters:\n  channels: -4\n")
    assert "spec.hyperparameters.channels" in refused(page, "#spec-errors")
    assert "channels: -4" in page.input_value("#spec_yaml")
    page.fill("#spec_yaml", "name: yaml-job\nworkload: digits-cnn\nmin_workers: 1\nmax_workers: 1\nsteps: 5\n")
    page.click(SUBMIT)
    page.wait_for_url("**/jobs/*/")
    assert "yaml-job" in page.locator("h1").inner_text()


def test_submit_your_own_code_through_the_form(browser_platform: Any, chromium: Any, tmp_path: Path) -> None:
    archive = tmp_path / "rings.tar.gz"
    archive.write_bytes(tar_gz(directory_files(RINGS), top="rings/"))
    page = log_in(chromium, browser_platform, "alice")
    page.goto(browser_platform.base_url + "/jobs/new/")
    page.fill("#name", "my-own-code")
    page.check("#source-own-code")
    assert page.locator("#code_file").is_visible() and not page.locator("#hp-digits-mlp-lr").is_visible()
    assert not page.locator("#workload").is_visible() and not page.locator("#hyperparameters-title").is_visible()
    screenshot(page, "submit-own-code")
    page.set_input_files("#code_file", str(archive))
    page.fill("#entrypoint", "task:RingsTask")
    page.fill("#code_hyperparameters", "hidden: 16\n")  # batch_size forgotten
    page.fill("#eval_every_steps", "20")
    page.fill("#length", "100000")
    assert "batch size" in refused(page, "#code_hyperparameters-error")
    assert "uploaded:" in page.locator("#code_file-help").inner_text(), "the archive is kept for the next try"
    screenshot(page, "submit-own-code-error")

    page.fill("#code_hyperparameters", "batch_size: 24\nhidden: 16\n")
    page.click(SUBMIT)
    page.wait_for_url("**/jobs/*/")
    assert "task:RingsTask" in page.content()
    shows_it_training(page)
    page.wait_for_selector("#metrics-figure:not([hidden]) .u-legend", timeout=60_000)
    legend = page.locator("#metrics-figure .u-legend").inner_text()
    assert "accuracy (train)" in legend
    page.wait_for_function(
        "() => document.querySelector('#metrics-figure .u-legend')?.textContent.includes('accuracy (eval)')",
        timeout=60_000,
    )
    screenshot(page, "job-page-own-code")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel")
    button = page.locator("#download-model")
    button.wait_for(state="visible", timeout=60_000)
    with page.expect_download() as download:
        button.click()
    saved = tmp_path / "model.pt"
    download.value.save_as(saved)
    state = torch.load(saved, weights_only=True)
    assert {"0.weight", "1.running_mean"} <= set(state), "the model's own state dict"
    screenshot(page, "job-page-model-kept")
