// The job list, kept live: state, workers and progress of each row change as they happen.
(function () {
  "use strict";
  const boot = BungeeLive.bootstrap();
  const rowOf = (id) => document.querySelector('#jobs tr[data-job="' + id + '"]');
  const matches = (job) => (!boot.filter.state || job.state === boot.filter.state) &&
    (!boot.filter.owner || job.owner === boot.filter.owner);

  // A job submitted while the page is open gets a row of its own at the top.
  function addRow(job) {
    const row = document.createElement("tr");
    row.dataset.job = job.id;
    const cell = (text, field) => {
      const td = document.createElement("td");
      if (field) td.dataset.field = field;
      if (text !== null) td.textContent = text;
      return td;
    };
    const name = cell(null);
    if (boot.viewer.is_staff || job.owner === boot.viewer.username) {
      const link = document.createElement("a");
      link.href = "/jobs/" + job.id + "/";
      link.textContent = job.name;
      name.appendChild(link);
    } else {
      name.textContent = job.name;
    }
    const state = cell(null);
    const badge = document.createElement("span");
    badge.dataset.field = "state";
    state.appendChild(badge);
    row.append(cell(String(job.id)), name, cell(job.owner), cell(job.workload), state, cell("", "workers"), cell("", "progress"));
    const body = document.querySelector("#jobs tbody");
    const empty = body.querySelector("td[colspan]");
    if (empty) empty.parentElement.remove();
    body.prepend(row);
    return row;
  }

  BungeeLive.on(function (message) {
    if (message.type === "job") {
      let row = rowOf(message.job.id);
      if (!row && matches(message.job)) row = addRow(message.job);
      if (!row) return;
      const state = row.querySelector('[data-field="state"]');
      state.textContent = message.job.state;
      state.className = "state state-" + message.job.state;
      row.querySelector('[data-field="workers"]').innerHTML =
        message.job.workers + " <small>(" + message.job.min_workers + "–" + message.job.max_workers + ")</small>";
      row.querySelector('[data-field="progress"]').textContent = message.job.steps_done + " / " + message.job.total_steps;
    } else if (message.type === "job_progress") {
      const row = rowOf(message.job_id);
      if (row) row.querySelector('[data-field="progress"]').textContent = message.steps_done + " / " + message.total_steps;
    }
  });
})();
