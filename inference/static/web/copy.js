// Copy buttons: a button with data-copy-from="ID" copies that element's value (an input) or its
// text, and says how it went in the element named by its data-copy-status (a live region).
(function () {
  "use strict";
  function say(button, text) {
    var status = document.getElementById(button.dataset.copyStatus || "");
    if (status) { status.textContent = text; }
  }
  function bySelection(source) { // without the Clipboard API (a page served over plain http)
    if (typeof source.select === "function") {
      source.focus();
      source.select();
    } else {
      var range = document.createRange();
      range.selectNodeContents(source);
      var selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
    }
    try { return document.execCommand("copy"); } catch (error) { return false; }
  }
  document.querySelectorAll("button[data-copy-from]").forEach(function (button) {
    button.addEventListener("click", function () {
      var source = document.getElementById(button.dataset.copyFrom);
      if (!source) { return; }
      var text = "value" in source ? source.value : source.textContent;
      function copied() { say(button, "Copied."); }
      function fallback() { if (bySelection(source)) { copied(); } else { say(button, "Selected: press Ctrl+C (⌘C) to copy."); } }
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(copied, fallback);
      } else {
        fallback();
      }
    });
  });
}());
