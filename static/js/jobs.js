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
    const reason = cell("", "reason");
    reason.className = "reason";
    row.append(cell(String(job.id)), name, cell(job.owner), cell(job.workload), state, cell("", "workers"),
      cell("", "progress"), reason);
    const body = document.querySelector("#jobs tbody");
    const empty = body.querySelector("td[colspan]");
    if (empty) empty.parentElement.remove();
    body.prepend(row);
    return row;
  }

  function showJob(job) {
    let row = rowOf(job.id);
    if (!row && matches(job)) row = addRow(job);
    if (!row) return;
    const state = row.querySelector('[data-field="state"]');
    state.textContent = job.state;
    state.className = "state state-" + job.state;
    row.querySelector('[data-field="workers"]').innerHTML =
      job.workers + " <small>(" + job.min_workers + "–" + job.max_workers + ")</small>";
    row.querySelector('[data-field="progress"]').textContent = job.steps_done + " / " + job.total_steps;
    showReason(row, job);
  }

  // Why a job of the viewer's (any, for staff) ended: the live events carry no reason (everyone
  // receives them), so it is read from the list API, which gives it to whoever may manage the job.
  const ENDED = new Set(["failed", "cancelled"]);
  const mayManage = (job) => boot.viewer.is_staff || job.owner === boot.viewer.username;
  function showReason(row, job) {
    const cell = row.querySelector('[data-field="reason"]');
    if (job.reason !== undefined) {
      cell.textContent = job.reason;
      if (job.reason) cell.title = job.reason; else cell.removeAttribute("title");
    } else if (ENDED.has(job.state) && mayManage(job) && !cell.textContent) {
      fetch("/api/jobs?limit=1&before=" + (job.id + 1), { credentials: "same-origin" })
        .then((reply) => (reply.ok ? reply.json() : []))
        .then((jobs) => jobs.filter((listed) => listed.id === job.id && listed.reason !== undefined)
          .forEach((listed) => showReason(row, listed)));
    }
  }

  // The socket's snapshot (at every connect, taken after it joined its groups) holds the active
  // jobs: what changed while the socket was away. A row shown as active whose job is not among
  // them ended meanwhile; its end is read from the list API (everyone may read it there).
  const ACTIVE = new Set(["queued", "running", "resizing"]);
  function catchUp(active) {
    const now = new Map(active.map((job) => [job.id, job]));
    // Rows shown are updated; a job newer than every row was submitted meanwhile and gets one (an
    // older job not shown is beyond the list's 500 rows: it stays out, as at the page's load).
    const shown = [...document.querySelectorAll("#jobs tr[data-job]")].map((row) => Number(row.dataset.job));
    const newest = Math.max(0, ...shown);
    now.forEach((job) => { if (rowOf(job.id) || job.id > newest) showJob(job); });
    document.querySelectorAll("#jobs tr[data-job]").forEach((row) => {
      const id = Number(row.dataset.job);
      if (now.has(id) || !ACTIVE.has(row.querySelector('[data-field="state"]').textContent.trim())) return;
      fetch("/api/jobs?limit=1&before=" + (id + 1), { credentials: "same-origin" })
        .then((reply) => (reply.ok ? reply.json() : []))
        .then((jobs) => jobs.filter((job) => job.id === id).forEach(showJob));
    });
  }

  BungeeLive.on(function (message) {
    if (message.type === "job") {
      showJob(message.job);
    } else if (message.type === "jobs") {
      message.jobs.forEach(showJob);
    } else if (message.type === "cluster" && message.cluster.jobs) {
      catchUp(message.cluster.jobs);
    } else if (message.type === "job_progress") {
      const row = rowOf(message.job_id);
      if (row) row.querySelector('[data-field="progress"]').textContent = message.steps_done + " / " + message.total_steps;
    }
  });
})();
