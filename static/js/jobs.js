// The job list, kept live: state, workers and progress of each row change as they happen.
(function () {
  "use strict";
  const rowOf = (id) => document.querySelector('#jobs tr[data-job="' + id + '"]');
  BungeeLive.on(function (message) {
    if (message.type === "job") {
      const row = rowOf(message.job.id);
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
