// Light and dark themes: the saved choice, else the system's. Runs before the page paints.
(function () {
  "use strict";
  const saved = localStorage.getItem("bungee-theme");
  const system = window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  document.documentElement.dataset.theme = saved || system;
  document.addEventListener("DOMContentLoaded", function () {
    const button = document.getElementById("theme-toggle");
    if (!button) return;
    const label = () => {
      const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
      button.textContent = next === "dark" ? "Dark theme" : "Light theme";
      button.setAttribute("aria-label", "Switch to the " + next + " theme");
    };
    label();
    button.addEventListener("click", function () {
      const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
      document.documentElement.dataset.theme = next;
      localStorage.setItem("bungee-theme", next);
      label();
    });
  });
})();
