// The submit form: show the chosen workload's hyperparameters and the chosen consistency mode's
// fields; load an uploaded YAML file into the text area so the person sees what will be sent.
(function () {
  "use strict";
  const select = document.getElementById("workload");
  function showChosen() {
    document.querySelectorAll("fieldset.hyper").forEach(function (set) {
      const chosen = set.dataset.workload === select.value;
      set.hidden = !chosen;
      set.querySelectorAll("input, textarea").forEach((input) => { input.disabled = !chosen; });
    });
  }
  select.addEventListener("change", showChosen);
  showChosen();
  // Only the chosen consistency mode's own fields are shown and sent.
  const modes = document.querySelectorAll("input[name=consistency]");
  function showMode() {
    const chosen = document.querySelector("input[name=consistency]:checked");
    document.querySelectorAll(".mode-fields").forEach(function (set) {
      const on = chosen !== null && set.dataset.mode === chosen.value;
      set.hidden = !on;
      set.querySelectorAll("input, select").forEach((input) => { input.disabled = !on; });
    });
  }
  modes.forEach((radio) => radio.addEventListener("change", showMode));
  showMode();
  const file = document.getElementById("spec_file");
  file.addEventListener("change", async function () {
    if (!file.files.length) return;
    document.getElementById("spec_yaml").value = await file.files[0].text();
    file.value = "";
  });
  const firstInvalid = document.querySelector("[aria-invalid=true]");
  if (firstInvalid) firstInvalid.focus();
})();
