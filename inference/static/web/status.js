// Live engine status: rows of the #engine-status table, from the authenticated websocket.
(function () {
  "use strict";
  var table = document.getElementById("engine-status");
  if (!table) { return; }
  var body = table.querySelector("tbody");
  function cell(text) { var td = document.createElement("td"); td.textContent = text; return td; }
  function render(models) {
    body.textContent = "";
    if (!models.length) { var tr = document.createElement("tr"); var td = cell("No model loaded."); td.colSpan = 5; tr.appendChild(td); body.appendChild(tr); return; }
    models.forEach(function (m) {
      var tr = document.createElement("tr");
      tr.dataset.model = m.model;
      [m.model, m.waiting, m.running, m.tokens_per_second.toFixed(1),
       m.cache_max ? (m.cache_bytes / 1e6).toFixed(1) + " of " + (m.cache_max / 1e6).toFixed(1) + " MB" : "off"
      ].forEach(function (v) { tr.appendChild(cell(String(v))); });
      body.appendChild(tr);
    });
  }
  var shares = document.getElementById("team-shares");
  function renderShares(teams) {
    if (!shares || !teams) { return; }
    var rows = shares.querySelector("tbody");
    rows.textContent = "";
    if (!teams.length) { var tr = document.createElement("tr"); var td = cell("No team has work now."); td.colSpan = 6; tr.appendChild(td); rows.appendChild(tr); return; }
    teams.forEach(function (t) {
      var tr = document.createElement("tr");
      tr.dataset.team = t.team;
      [t.model, t.team, t.waiting, t.running, t.tokens_per_second.toFixed(1), Math.round(t.share * 100) + " %"
      ].forEach(function (v) { tr.appendChild(cell(String(v))); });
      rows.appendChild(tr);
    });
  }
  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + location.host + table.dataset.socket);
    socket.onmessage = function (event) {
      var data = JSON.parse(event.data);
      render(data.models);
      renderShares(data.teams);
      table.dataset.updated = Date.now();
    };
    socket.onclose = function () { setTimeout(connect, 2000); };
  }
  connect();
}());
