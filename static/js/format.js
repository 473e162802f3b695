// Wording and colours the pages share: a count with its noun ("1 worker", "2 workers", the rule
// of elastic/wording.py), and each job's colour, the same on every page and in both themes.
(function () {
  "use strict";
  function counted(number, noun, plural) {
    return number + " " + (number === 1 ? noun : plural || noun + "s");
  }

  // A job's colour is a point of the R2 sequence (the plastic number's 2-D analogue of golden-
  // angle stepping): the hue and a lightness step, both by job id. Jobs whose ids are close, as
  // those on the board at once are, get clearly different colours far beyond the dozen that a
  // hue alone tells apart. The stylesheet maps the step into each theme's lightness band, which
  // keeps the bar's text at 4.5:1 or better.
  const HUE_STEP = 0.7548776662466927;  // 1 / plastic number
  const TONE_STEP = 0.5698402909980532;  // 1 / plastic number squared
  const frac = (x) => x - Math.floor(x);
  function jobColour(id) {
    return "--job-hue:" + (frac(id * HUE_STEP) * 360).toFixed(1) + ";--job-tone:" + frac(0.5 + id * TONE_STEP).toFixed(3);
  }

  // A span of time as people say it: "42 s", "11 min 53 s", "2 h 5 min".
  function duration(seconds) {
    const s = Math.max(0, Math.round(seconds));
    return s < 60 ? s + " s" : s < 3600 ? Math.floor(s / 60) + " min " + (s % 60) + " s" : Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  window.BungeeFormat = { counted: counted, jobColour: jobColour, duration: duration };
})();
