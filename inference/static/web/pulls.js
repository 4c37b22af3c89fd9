// Pulls from the hub, live: the list and a pull's page show each pull's state, bytes, rate and
// time left in elements marked data-pull="ID" data-field="..."; this reads them every
// data-refresh-ms from the progress view (JSON) while one of them is still running.
(function () {
  "use strict";
  var box = document.getElementById("pull-live");
  if (!box) { return; }
  var every = parseInt(box.dataset.refreshMs, 10) || 1000;
  var marked = document.querySelectorAll("[data-pull]");
  var ids = [];
  marked.forEach(function (element) {
    if (ids.indexOf(element.dataset.pull) < 0) { ids.push(element.dataset.pull); }
  });
  if (!ids.length) { return; }

  function show(pull) {
    document.querySelectorAll('[data-pull="' + pull.id + '"]').forEach(function (element) {
      var field = element.dataset.field;
      if (field === "bar") {
        element.max = pull.total_bytes || 1;
        element.value = pull.active ? pull.done_bytes : (pull.state === "done" ? element.max : pull.done_bytes);
      } else if (field === "cancel") {
        element.hidden = !pull.active;
      } else if (field === "model") {
        if (pull.model_url && !element.querySelector("a")) {
          var link = document.createElement("a");
          link.href = pull.model_url;
          link.textContent = pull.name;
          element.textContent = "";
          element.appendChild(link);
        }
      } else if (field === "error") {
        element.textContent = pull.error || "-";
      } else if (pull.shown && field in pull.shown) {
        element.textContent = pull.shown[field];
      }
    });
  }

  function refresh() {
    var url = box.dataset.progressUrl + "?ids=" + ids.join(",");
    fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (response) { return response.ok ? response.json() : null; })
      .then(function (data) {
        if (!data) { setTimeout(refresh, every * 5); return; }
        var running = false;
        data.pulls.forEach(function (pull) { show(pull); running = running || pull.active; });
        box.dataset.updated = String(Date.now());
        if (running) { setTimeout(refresh, every); }
      })
      .catch(function () { setTimeout(refresh, every * 5); });
  }
  refresh();
}());
