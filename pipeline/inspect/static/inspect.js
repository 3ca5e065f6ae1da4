// One delegated listener for the token view: nothing is attached per token.
(function () {
  "use strict";
  var tokens = document.getElementById("tokens");
  var tip = document.getElementById("tip");
  if (!tokens || !tip) { return; }
  function show(event) {
    var el = event.target;
    if (!el.dataset || el.dataset.tokenId === undefined) { return; }
    var d = el.dataset;
    tip.textContent = "id " + d.tokenId + " · piece " + JSON.stringify(el.textContent) +
      " · logprob " + d.logprob + " · weight version " + d.version + " · call " + d.call +
      (d.mask === "1" ? " · generated" : " · prompt/tool (mask 0)");
    tip.dataset.logprob = d.logprob;
    tip.dataset.tokenId = d.tokenId;
  }
  tokens.addEventListener("mouseover", show);
  tokens.addEventListener("focusin", show);
})();
