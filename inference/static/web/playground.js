// The playground (templates/web/playground.html): a conversation with a chat model through
// POST /v1/chat/completions, streamed (fetch() and SSE), with a key this page makes from one of
// the member's keys and ends when it is left. The request is shown as curl and Python to copy
// (the buttons are copy.js's).
(function () {
  "use strict";
  var root = document.getElementById("playground");
  if (!root) { return; }
  function $(id) { return document.getElementById(id); }
  var el = {
    model: $("pg-model"), key: $("pg-key"), system: $("pg-system"),
    temperature: $("pg-temperature"), topP: $("pg-top-p"), maxTokens: $("pg-max-tokens"),
    tools: $("pg-tools"), json: $("pg-json"), schemaBox: $("pg-schema-box"), schema: $("pg-schema"),
    messages: $("pg-messages"), compose: $("pg-compose"), input: $("pg-input"),
    inputLabel: $("pg-input-label"), send: $("pg-send"), stop: $("pg-stop"), clear: $("pg-clear"),
    status: $("pg-status"), ttft: $("pg-ttft"), usage: $("pg-usage"), speed: $("pg-speed"),
    curl: $("pg-curl"), python: $("pg-python")
  };
  var csrf = document.querySelector("#pg-settings input[name=csrfmiddlewaretoken]").value;
  var SAMPLE_TOOL = {
    type: "function",
    function: {
      name: "get_weather",
      description: "The current weather in a city.",
      parameters: {
        type: "object",
        properties: { city: { type: "string", description: "The city's name." } },
        required: ["city"]
      }
    }
  };

  var history = [];   // the conversation so far, as the API's messages
  var session = null; // this page's playground key: {id, key, model, parent}
  var running = null; // the AbortController of the request in flight
  var sent = null;    // the body last sent: the code shows it until the form changes

  function setStatus(text, isError) {
    el.status.textContent = text;
    el.status.classList.toggle("error", Boolean(isError));
  }

  // Keys offered: those that may use the chosen model.
  function filterKeys() {
    var model = el.model.value, first = null;
    Array.prototype.forEach.call(el.key.options, function (option) {
      var allowed = option.dataset.models.split(" ").indexOf(model) >= 0;
      option.hidden = !allowed;
      option.disabled = !allowed;
      if (allowed && first === null) { first = option; }
    });
    var chosen = el.key.options[el.key.selectedIndex];
    if ((!chosen || chosen.disabled) && first) { el.key.value = first.value; }
  }

  function post(url, fields, keepalive) {
    var form = new FormData();
    form.append("csrfmiddlewaretoken", csrf);
    Object.keys(fields).forEach(function (name) { form.append(name, fields[name]); });
    return fetch(url, { method: "POST", body: form, credentials: "same-origin", keepalive: Boolean(keepalive) });
  }

  async function ensureKey() {
    var model = el.model.value, parent = el.key.value;
    if (session && session.model === model && session.parent === parent) { return session; }
    endKey(false);
    var response = await post(root.dataset.keyUrl, { model: model, key: parent });
    var data = await response.json().catch(function () { return { error: "Your session has ended: sign in again." }; });
    if (!response.ok || !data.key) { // a sign-in page instead (signed out elsewhere) has no key
      throw new Error(data.error || "The playground could not make its key (" + response.status + ").");
    }
    session = { id: data.id, key: data.key, model: model, parent: parent };
    return session;
  }

  function endKey(leaving) {
    if (!session) { return; }
    var id = String(session.id);
    session = null;
    if (leaving && navigator.sendBeacon) {
      var form = new FormData();
      form.append("csrfmiddlewaretoken", csrf);
      form.append("id", id);
      navigator.sendBeacon(root.dataset.endUrl, form);
    } else {
      post(root.dataset.endUrl, { id: id }, true).catch(function () { /* it expires within the hour */ });
    }
  }

  function number(input) {
    var value = input.value.trim();
    return value === "" ? null : Number(value);
  }

  function pendingMessage(text) {
    var last = history[history.length - 1];
    if (last && last.tool_calls && last.tool_calls.length) {
      return { role: "tool", tool_call_id: last.tool_calls[0].id, content: text };
    }
    return { role: "user", content: text };
  }

  function buildBody(text) {
    var messages = [];
    var system = el.system.value.trim();
    if (system) { messages.push({ role: "system", content: system }); }
    messages = messages.concat(history);
    if (text) { messages.push(pendingMessage(text)); }
    var body = { model: el.model.value, messages: messages };
    [["temperature", el.temperature], ["top_p", el.topP], ["max_tokens", el.maxTokens]].forEach(function (field) {
      var value = number(field[1]);
      if (value !== null) { body[field[0]] = value; }
    });
    if (el.tools.checked) { body.tools = [SAMPLE_TOOL]; }
    if (el.json.checked) {
      var schema;
      try { schema = JSON.parse(el.schema.value); } catch (e) { throw new Error("The JSON schema is not valid JSON: " + e.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", strict: true, schema: schema } };
    }
    body.stream = true;
    body.stream_options = { include_usage: true };
    return body;
  }

  // Python literals for JSON values, indented as a person would write them.
  function py(value, indent) {
    var inner = indent + "    ";
    if (value === null || value === undefined) { return "None"; }
    if (value === true) { return "True"; }
    if (value === false) { return "False"; }
    if (typeof value === "number") { return String(value); }
    if (typeof value === "string") { return JSON.stringify(value); }
    if (Array.isArray(value)) {
      if (!value.length) { return "[]"; }
      return "[\n" + value.map(function (v) { return inner + py(v, inner) + ",\n"; }).join("") + indent + "]";
    }
    var names = Object.keys(value);
    if (!names.length) { return "{}"; }
    return "{\n" + names.map(function (k) { return inner + JSON.stringify(k) + ": " + py(value[k], inner) + ",\n"; }).join("") + indent + "}";
  }

  function pythonCode(body) {
    var args = Object.keys(body).map(function (name) { return "    " + name + "=" + py(body[name], "    ") + ",\n"; }).join("");
    return "import os\n\nfrom openai import OpenAI\n\n" +
      "client = OpenAI(base_url=" + JSON.stringify(root.dataset.baseUrl) + ", api_key=os.environ[\"ORCHARD_API_KEY\"])\n" +
      "stream = client.chat.completions.create(\n" + args + ")\n" +
      "for chunk in stream:\n" +
      "    for choice in chunk.choices:\n" +
      "        print(choice.delta.content or \"\", end=\"\", flush=True)\n" +
      "        for call in choice.delta.tool_calls or []:\n" +
      "            if call.function:\n" +
      "                print(call.function.name or \"\", call.function.arguments or \"\", sep=\"\", end=\"\")\n" +
      "    if chunk.usage:\n" +
      "        print(f\"\\n{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens\")\n";
  }

  function curlCode(body) {
    var json = JSON.stringify(body, null, 2).replace(/'/g, "'\\''");
    return "curl -N " + root.dataset.baseUrl + "/chat/completions \\\n" +
      "  -H \"Authorization: Bearer $ORCHARD_API_KEY\" \\\n" +
      "  -H \"Content-Type: application/json\" \\\n" +
      "  -d '" + json + "'\n";
  }

  function renderCode() {
    var body = sent;
    if (!body) {
      try { body = buildBody(el.input.value.trim()); } catch (e) { return; }
    }
    el.curl.textContent = curlCode(body);
    el.python.textContent = pythonCode(body);
  }

  function formChanged() {
    sent = null;
    renderCode();
  }

  var ROLES = { system: "System", user: "You", assistant: "Assistant", tool: "Tool result" };

  function addMessage(role, text) {
    var item = document.createElement("li");
    item.className = "pg-message pg-" + role;
    var label = document.createElement("span");
    label.className = "pg-role";
    label.textContent = ROLES[role];
    item.appendChild(label);
    if (role === "assistant") {
      var reasoning = document.createElement("div");
      reasoning.className = "pg-reasoning";
      reasoning.hidden = true;
      item.appendChild(reasoning);
    }
    var body = document.createElement("div");
    body.className = "pg-text";
    body.textContent = text;
    item.appendChild(body);
    el.messages.appendChild(item);
    return item;
  }

  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
    el.messages.setAttribute("aria-busy", busy ? "true" : "false");
  }

  async function readEvents(stream, onData) {
    var reader = stream.getReader(), decoder = new TextDecoder(), buffer = "";
    for (;;) {
      var part = await reader.read();
      if (part.done) { return; }
      buffer += decoder.decode(part.value, { stream: true });
      var events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (var i = 0; i < events.length; i++) {
        var data = events[i].split(/\r?\n/).filter(function (line) { return line.indexOf("data:") === 0; })
          .map(function (line) { return line.slice(5).replace(/^ /, ""); }).join("\n");
        if (!data) { continue; }
        if (data === "[DONE]") { return; }
        onData(JSON.parse(data));
      }
    }
  }

  function call(key, body, signal) {
    return fetch(root.dataset.baseUrl + "/chat/completions", {
      method: "POST",
      headers: { "Authorization": "Bearer " + key.key, "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: signal,
      credentials: "omit"
    });
  }

  async function errorOf(response) {
    var data = await response.json().catch(function () { return null; });
    return (data && data.error && data.error.message) || ("The server answered " + response.status + ".");
  }

  async function submit() {
    if (running) { return; }
    var text = el.input.value.trim();
    if (!text) { setStatus("Write a message first.", true); el.input.focus(); return; }
    var invalid = [el.temperature, el.topP, el.maxTokens].filter(function (input) { return !input.checkValidity(); })[0];
    if (invalid) { setStatus(invalid.labels[0].textContent + ": " + invalid.validationMessage, true); invalid.focus(); return; }
    var body;
    try { body = buildBody(text); } catch (e) { setStatus(e.message, true); el.schema.focus(); return; }
    var pending = pendingMessage(text);
    var asked = addMessage(pending.role, text);
    var reply = addMessage("assistant", "");
    var replyText = reply.querySelector(".pg-text"), replyReasoning = reply.querySelector(".pg-reasoning");
    el.input.value = "";
    sent = body;
    renderCode();
    setStatus("Generating…");
    el.ttft.textContent = el.usage.textContent = el.speed.textContent = "—";
    running = new AbortController();
    setBusy(true);
    var assistant = { role: "assistant", content: "" }, calls = [], deltas = 0, first = null, usage = null, started = null;
    function show() {
      var shown = assistant.content;
      calls.forEach(function (c) { shown += (shown ? "\n" : "") + "→ " + c.function.name + "(" + c.function.arguments + ")"; });
      replyText.textContent = shown;
      reply.dataset.deltas = String(deltas);
    }
    try {
      var key = await ensureKey();
      started = performance.now();
      var response = await call(key, body, running.signal);
      if (response.status === 401) { // the key's hour is over: make another, once
        session = null;
        key = await ensureKey();
        started = performance.now();
        response = await call(key, body, running.signal);
      }
      if (!response.ok) { throw new Error(await errorOf(response)); }
      await readEvents(response.body, function (chunk) {
        if (chunk.error) { throw new Error(chunk.error.message); }
        if (chunk.usage) { usage = chunk.usage; }
        (chunk.choices || []).forEach(function (choice) {
          var delta = choice.delta || {};
          if (delta.content || delta.reasoning_content || delta.tool_calls) {
            deltas += 1;
            if (first === null) {
              first = performance.now();
              el.ttft.textContent = Math.round(first - started) + " ms";
            }
          }
          if (delta.content) { assistant.content += delta.content; }
          if (delta.reasoning_content) {
            replyReasoning.hidden = false;
            replyReasoning.textContent += delta.reasoning_content;
          }
          (delta.tool_calls || []).forEach(function (part) {
            var index = part.index || 0;
            var c = calls[index] = calls[index] || { id: part.id, type: "function", function: { name: "", arguments: "" } };
            if (part.id) { c.id = part.id; }
            if (part.function && part.function.name) { c.function.name += part.function.name; }
            if (part.function && part.function.arguments) { c.function.arguments += part.function.arguments; }
          });
        });
        show();
      });
      setStatus("Done.");
    } catch (e) {
      if (e.name !== "AbortError") {
        asked.remove();
        reply.remove();
        el.input.value = text;
        sent = null;
        renderCode();
        setStatus(e.message, true);
        return;
      }
      setStatus("Stopped.");
    } finally {
      running = null;
      setBusy(false);
      if (usage) {
        el.usage.textContent = usage.prompt_tokens + " prompt + " + usage.completion_tokens + " completion = " + usage.total_tokens;
        if (first !== null && usage.completion_tokens > 1) {
          var seconds = (performance.now() - first) / 1000;
          if (seconds > 0) { el.speed.textContent = ((usage.completion_tokens - 1) / seconds).toFixed(1) + " tokens/s"; }
        }
      }
    }
    if (calls.length) { assistant.tool_calls = calls; }
    if (!assistant.content && calls.length) { assistant.content = null; }
    history.push(pending, assistant);
    show();
    el.inputLabel.textContent = calls.length ? "Tool result for " + calls[0].function.name : "Your message";
    el.input.focus();
  }

  el.compose.addEventListener("submit", function (event) { event.preventDefault(); submit(); });
  el.input.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); submit(); }
  });
  el.stop.addEventListener("click", function () { if (running) { running.abort(); } });
  el.clear.addEventListener("click", function () {
    history = [];
    el.messages.textContent = "";
    el.inputLabel.textContent = "Your message";
    el.ttft.textContent = el.usage.textContent = el.speed.textContent = "—";
    setStatus("");
    formChanged();
  });
  el.model.addEventListener("change", function () { filterKeys(); endKey(false); formChanged(); });
  el.key.addEventListener("change", function () { endKey(false); });
  el.json.addEventListener("change", function () { el.schemaBox.hidden = !el.json.checked; formChanged(); });
  [el.system, el.temperature, el.topP, el.maxTokens, el.tools, el.schema, el.input].forEach(function (input) {
    input.addEventListener("input", formChanged);
  });
  el.tools.addEventListener("change", formChanged);

  window.addEventListener("pagehide", function () {
    if (running) { running.abort(); }
    endKey(true);
  });

  filterKeys();
  renderCode();
}());
