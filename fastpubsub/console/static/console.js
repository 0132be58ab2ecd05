// Refreshes the figures of a console page in place: every few seconds the page
// is fetched again and each element marked data-refresh is replaced by its new
// version. Nothing else changes, so a form being filled in is left alone. With
// JavaScript off the pages work the same; reloading refreshes them.
(function () {
  "use strict";
  var main = document.getElementById("main");
  if (!main || !main.dataset.refreshEvery || !window.fetch || !window.DOMParser) {
    return;
  }
  var every = Number(main.dataset.refreshEvery) * 1000;
  function refresh() {
    if (document.hidden) {
      return;
    }
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (answer) {
        if (!answer.ok || answer.redirected) {
          throw new Error("not refreshed");
        }
        return answer.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-refresh]").forEach(function (old) {
          var found = fresh.querySelector('[data-refresh="' + CSS.escape(old.dataset.refresh) + '"]');
          if (found && !old.contains(document.activeElement)) {
            old.replaceWith(document.importNode(found, true));
          }
        });
      })
      .catch(function () { /* the next round tries again */ });
  }
  window.setInterval(refresh, every);
}());
