// The submit form: show what the chosen source needs (your own code's archive, or the chosen
// catalogue workload and its hyperparameters) and the chosen consistency mode's fields; load an
// uploaded YAML file into the text area so the person sees what will be sent.
(function () {
  "use strict";
  const select = document.getElementById("workload");
  const sources = document.querySelectorAll("input[name=source]");
  function showChosen() {
    const ownCode = document.getElementById("source-own-code").checked;
    const workload = ownCode ? "own-code" : select.value;
    document.querySelectorAll(".hyper[data-workload], .source-fields[data-workload]").forEach(function (set) {
      const name = set.dataset.workload;
      const chosen = name === workload || (name === "catalogue" && !ownCode);
      set.hidden = !chosen;
      set.querySelectorAll("input, textarea, select").forEach((input) => { input.disabled = !chosen; });
    });
    document.getElementById("hyperparameters-title").hidden = ownCode;
  }
  select.addEventListener("change", showChosen);
  sources.forEach((radio) => radio.addEventListener("change", showChosen));
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
