// AGQ console: keeps the operator's token in sessionStorage (this tab
// only) and sends it as a bearer token on every htmx request; shows the
// server's answers and refusals in the alert area; pauses a live region's
// refresh while the keyboard focus is inside it.
(function () {
  "use strict";
  var KEY = "agq-console-token";
  function token() {
    try { return sessionStorage.getItem(KEY) || ""; } catch (e) { return ""; }
  }
  function flash(text, kind) {
    var el = document.getElementById("flash");
    if (!el) return;
    el.textContent = text;
    el.className = kind || "";
  }
  function showTokenState() {
    var s = document.getElementById("token-state");
    var form = document.getElementById("token-form");
    if (!s || !form || form.dataset.auth !== "on") return;
    s.textContent = token() ? "token set (this tab)" : "no token";
  }
  document.addEventListener("DOMContentLoaded", function () {
    showTokenState();
    var form = document.getElementById("token-form");
    if (form && form.dataset.auth === "on") {
      form.addEventListener("submit", function (ev) {
        ev.preventDefault();
        var input = document.getElementById("token");
        var t = input.value.trim();
        try {
          if (t) sessionStorage.setItem(KEY, t); else sessionStorage.removeItem(KEY);
        } catch (e) { flash("This browser does not allow storing the token.", "error"); }
        input.value = "";
        showTokenState();
        flash(t ? "Token set for this tab." : "Token cleared.", "ok");
        document.body.dispatchEvent(new Event("agq-refresh"));
      });
      var forget = document.getElementById("forget-token");
      forget.addEventListener("click", function () {
        try { sessionStorage.removeItem(KEY); } catch (e) { /* nothing stored */ }
        showTokenState();
        flash("Token forgotten.", "ok");
        document.body.dispatchEvent(new Event("agq-refresh"));
      });
    }
  });
  document.addEventListener("htmx:configRequest", function (ev) {
    var t = token();
    if (t) ev.detail.headers["Authorization"] = "Bearer " + t;
  });
  // A timed refresh must not pull the focused button out from under the
  // keyboard: skip it while the focus is inside the live region.
  document.addEventListener("htmx:beforeRequest", function (ev) {
    var elt = ev.detail.elt;
    var focused = document.activeElement;
    if (elt && elt.hasAttribute("data-live") && focused && focused !== document.body &&
        elt.contains(focused) && !ev.detail.requestConfig.triggeringEvent) {
      ev.preventDefault();
    }
  });
  document.addEventListener("htmx:afterRequest", function (ev) {
    var xhr = ev.detail.xhr;
    var elt = ev.detail.elt;
    if (!xhr) return;
    var isButton = elt && elt.tagName === "BUTTON";
    if (xhr.status >= 400) {
      var msg = xhr.responseText || ("Request failed (" + xhr.status + ").");
      if (isButton) {
        flash(msg, "error");
      } else if (elt && elt.hasAttribute("data-live")) {
        var p = document.createElement("p");
        p.className = "refused";
        p.setAttribute("role", "alert");
        p.textContent = msg;
        elt.replaceChildren(p);
      }
    } else if (isButton) {
      flash(xhr.responseText, "ok");
    }
  });
  document.addEventListener("htmx:sendError", function () {
    flash("The console cannot reach the server; retrying every 2 s.", "error");
  });
})();
