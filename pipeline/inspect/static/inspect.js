// The token view's behaviour, with nothing attached per token: the tooltip follows
// mouseover and focusin on the tokens' container, and one click listener on the page
// handles shift-click ranges and the copy buttons.
(function () {
  "use strict";
  var tokens = document.getElementById("tokens");
  var tip = document.getElementById("tip");
  var status = document.getElementById("copy-status");
  if (!tokens || !tip || !status) { return; }
  var anchor = null;

  function show(event) {
    var el = event.target;
    if (!el.dataset || el.dataset.tokenId === undefined) { return; }
    var d = el.dataset;
    tip.textContent = "id " + d.tokenId + " · piece " + JSON.stringify(el.textContent) +
      " · logprob " + d.logprob +
      (d.trainerLogprob !== undefined ? " · trainer " + d.trainerLogprob + " · Δ " + d.delta : "") +
      " · weight version " + d.version + " · call " + d.call +
      (d.mask === "1" ? " · generated" : " · prompt/tool (mask 0)");
    tip.dataset.logprob = d.logprob;
    tip.dataset.tokenId = d.tokenId;
  }

  // The tokens the page's selection touches, in order; a shift-click range is a selection too.
  function selected() {
    var selection = window.getSelection();
    if (!selection || selection.isCollapsed) { return []; }
    return Array.prototype.filter.call(tokens.querySelectorAll("[data-token-id]"), function (el) {
      return selection.containsNode(el, true);
    });
  }

  function select(from, to) {
    var forward = from.compareDocumentPosition(to) & Node.DOCUMENT_POSITION_FOLLOWING;
    var range = document.createRange();
    range.setStartBefore(forward ? from : to);
    range.setEndAfter(forward ? to : from);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  // Without a secure context there is no navigator.clipboard: copy through a hidden
  // textarea, then give the user's selection back.
  function fallback(text) {
    var selection = window.getSelection();
    var kept = selection.rangeCount ? selection.getRangeAt(0) : null;
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    var ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    document.body.removeChild(area);
    if (kept) { selection.removeAllRanges(); selection.addRange(kept); }
    return ok;
  }

  function copy(kind) {
    var els = selected();
    if (!els.length) {
      status.textContent = "select tokens first: drag over them, or click one and shift-click another";
      status.dataset.copied = "";
      return;
    }
    var text = kind === "ids"
      ? els.map(function (el) { return el.dataset.tokenId; }).join(",")
      : els.map(function (el) { return el.textContent; }).join("");
    var what = kind === "ids" ? "copied " + els.length + " ids" : "copied the text of " + els.length + " tokens";
    function done(ok) {
      status.textContent = ok ? what : "the browser refused to copy";
      status.dataset.copied = ok ? text : "";
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { done(true); }, function () { done(fallback(text)); });
    } else {
      done(fallback(text));
    }
  }

  tokens.addEventListener("mouseover", show);
  tokens.addEventListener("focusin", show);
  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (button) { copy(button.dataset.copy); return; }
    var token = event.target.closest("#tokens [data-token-id]");
    if (!token) { return; }
    if (event.shiftKey && anchor && anchor !== token) {
      select(anchor, token);
    } else {
      anchor = token;
    }
  });
})();
