// The running-now page refreshes its table: every data-refresh-ms it reads the page again and
// puts in its new rows, except while the keyboard focus is inside the table (a Cancel button).
(function () {
  "use strict";
  var box = document.getElementById("running-now");
  if (!box) { return; }
  var every = parseInt(box.dataset.refreshMs, 10) || 2000;
  function refresh() {
    if (box.contains(document.activeElement)) { setTimeout(refresh, every); return; }
    fetch(location.pathname, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (!html || box.contains(document.activeElement)) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("running-now");
        if (fresh) { box.innerHTML = fresh.innerHTML; box.dataset.updated = String(Date.now()); }
      })
      .catch(function () {})
      .then(function () { setTimeout(refresh, every); });
  }
  setTimeout(refresh, every);
}());
