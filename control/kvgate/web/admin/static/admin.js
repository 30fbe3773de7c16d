/* kvgate admin page: progressive enhancement over plain forms and links.
 *  - actions (drain / undrain / warm, rollback, cache invalidate) confirm in a <dialog> and POST with
 *    fetch (CSRF token from <meta name="csrf-token">), then follow the node until the action completes;
 *  - the Fleet table refreshes every 2 s from /admin/fleet.json without reloading the page;
 *  - the 15-minute charts are drawn by uPlot (vendored from npm, static/vendor/) from /admin/history.json.
 * Without JavaScript every action still works: its link opens a confirmation page with a POST form. */
(function () {
  "use strict";
  var csrf = (document.querySelector('meta[name="csrf-token"]') || {}).content || "";
  var REFRESH_MS = 2000, CHART_MS = 5000, GIVE_UP_MS = 20 * 60 * 1000;
  var pending = {};  // node id -> {action, target, started (browser ms), at (server s, set by the POST's answer)}
  // the states an action passes through; any other one means someone or something undid it
  var PATH = { drain: ["draining", "drained"], undrain: ["warming", "ramping", "active"] };

  function toLogin() { window.location = "/admin/login?next=" + encodeURIComponent(location.pathname); }

  function toast(text, isError) {
    var box = document.getElementById("toasts");
    if (!box) return;
    var el = document.createElement("div");
    el.className = "toast" + (isError ? " error" : "");
    el.setAttribute("role", isError ? "alert" : "status");
    el.textContent = text;
    box.appendChild(el);
    setTimeout(function () { el.remove(); }, isError ? 12000 : 7000);
  }

  function confirmDialog(message, withForce) {
    var dlg = document.getElementById("confirm-dialog");
    if (!dlg || typeof dlg.showModal !== "function") {
      return Promise.resolve(window.confirm(message) ? { ok: true, force: false } : { ok: false });
    }
    document.getElementById("confirm-message").textContent = message;
    var forceRow = document.getElementById("confirm-force-row"), force = document.getElementById("confirm-force");
    forceRow.hidden = !withForce;
    force.checked = false;
    return new Promise(function (resolve) {
      dlg.addEventListener("close", function onClose() {
        dlg.removeEventListener("close", onClose);
        resolve({ ok: dlg.returnValue === "ok", force: force.checked });
      });
      dlg.returnValue = "";
      dlg.showModal();
      document.getElementById("confirm-cancel").focus();
    });
  }

  // a real form submission (the answer is a page with its message), after the dialog
  function submitForm(url, fields) {
    var form = document.createElement("form");
    form.method = "post";
    form.action = url;
    var all = Object.assign({ csrf_token: csrf }, fields || {});
    Object.keys(all).forEach(function (k) {
      var input = document.createElement("input");
      input.type = "hidden"; input.name = k; input.value = all[k];
      form.appendChild(input);
    });
    document.body.appendChild(form);
    form.submit();
  }

  function post(url, fields) {
    var body = new URLSearchParams(fields || {});
    body.set("csrf_token", csrf);
    return fetch(url, {
      method: "POST", body: body, credentials: "same-origin",
      headers: { "Accept": "application/json", "X-CSRFToken": csrf }
    }).then(function (resp) {
      var json = (resp.headers.get("Content-Type") || "").indexOf("application/json") === 0;
      if (resp.status === 401 || resp.redirected || !json) {
        // never take a sign-in page (or anything but our JSON) for success
        setTimeout(toLogin, 1500);
        throw new Error("not done: the session ended (HTTP " + resp.status + "); sign in again");
      }
      return resp.json().then(function (data) {
        if (!resp.ok) { throw new Error((data.error && data.error.message) || ("HTTP " + resp.status)); }
        return data;
      });
    });
  }

  // ------------------------------------------------------------------ actions
  document.addEventListener("click", function (ev) {
    var a = ev.target.closest && ev.target.closest("a.action[data-confirm]");
    if (!a || a.classList.contains("disabled")) return;
    ev.preventDefault();
    var action = a.dataset.action, node = a.dataset.node;
    confirmDialog(a.dataset.confirm, action === "drain").then(function (answer) {
      if (!answer.ok) return;
      var fields = answer.force ? { force: "1" } : {};
      if (!node) { submitForm(a.href, fields); return; }  // e.g. rollback: the next page says how it went
      pending[node] = { action: action, target: a.dataset.target, started: Date.now(), at: null };
      setProgress(node, action + " requested…", true);
      post(a.href, fields).then(function (data) {
        toast(data.message || "done");
        if (pending[node]) pending[node].at = data.at;
        refreshFleet();
      }).catch(function (err) {
        if (node) delete pending[node];
        toast(err.message, true);
        refreshFleet();
      });
    });
  });

  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (!form.classList || !form.classList.contains("js-confirm-form")) return;
    ev.preventDefault();
    confirmDialog(form.dataset.confirm, false).then(function (answer) {
      if (answer.ok) submitForm(form.dataset.post);
    });
  });

  // -------------------------------------------------------------- fleet table
  function setProgress(node, text, busy) {
    var row = document.querySelector('#fleet tr[data-node="' + node + '"]');
    if (!row) return;
    var cell = row.querySelector('[data-field="progress"]');
    if (cell) cell.textContent = text;
    row.classList.toggle("busy", !!busy);
  }

  function finish(node, text, isError) {
    delete pending[node];
    toast(text, isError);
  }

  function applyRow(r, at) {
    var row = document.querySelector('#fleet tr[data-node="' + r.id + '"]');
    if (!row) return;
    row.dataset.state = r.state;
    row.classList.toggle("busy", !!r.busy || !!pending[r.id]);
    Object.keys(r.cells).forEach(function (f) {
      var el = row.querySelector('[data-field="' + f + '"]');
      if (!el) return;
      el.textContent = r.cells[f];
      if (f === "state") { el.className = "state " + (r.classes.state || ""); }
      else if (el.tagName === "TD") { el.className = "num " + (r.classes[f] || ""); }
      if (r.title[f] !== undefined) el.title = r.title[f];
    });
    Object.keys(r.actions).forEach(function (act) {
      var link = row.querySelector('a.action[data-action="' + act + '"]');
      if (!link) return;
      link.classList.toggle("disabled", !r.actions[act]);
      if (r.actions[act]) { link.removeAttribute("aria-disabled"); link.removeAttribute("tabindex"); }
      else { link.setAttribute("aria-disabled", "true"); link.setAttribute("tabindex", "-1"); }
    });
    var p = pending[r.id];
    if (!p || p.at === null || at < p.at) return;  // only figures newer than the action's answer count
    var secs = ((Date.now() - p.started) / 1000).toFixed(1);
    if (p.action === "warm") {
      if (r.warmup_status !== "running" && (r.warmup_finished_at || 0) >= p.at - 1) {
        finish(r.id, r.id + ": warm-up " + r.warmup_status + " after " + secs + " s", r.warmup_status === "failed");
        return;
      }
    } else if (r.state === p.target) {
      finish(r.id, r.id + ": " + r.state + " after " + secs + " s");
      return;
    } else if (PATH[p.action] && PATH[p.action].indexOf(r.state) < 0) {
      finish(r.id, r.id + ": " + p.action + " did not complete: the node is " + r.state + " now (see Events)", true);
      return;
    }
    if (Date.now() - p.started > GIVE_UP_MS) {
      finish(r.id, r.id + ": " + p.action + " still not complete after " + Math.round(secs / 60) +
        " min; the row keeps showing its progress", true);
    } else if (!r.cells.progress) {
      setProgress(r.id, p.action + " in progress… (" + secs + " s)", true);
    }
  }

  var refreshing = false;
  function refreshFleet() {
    if (refreshing || !document.getElementById("fleet")) return;
    refreshing = true;
    fetch("/admin/fleet.json", { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (resp) {
        if (resp.status === 401) { toLogin(); throw new Error("signed out"); }
        return resp.json();
      })
      .then(function (data) {
        data.rows.forEach(function (r) { applyRow(r, data.at); });
        (data.pools || []).forEach(function (p) {
          var li = document.querySelector('#pool-lines li[data-pool="' + p.name + '"]');
          if (!li) return;
          li.querySelector('[data-field="balancer"]').textContent = p.balancer_in_force;
          li.querySelector('[data-field="degraded"]').textContent = p.degraded ? " (overload degrade)" : "";
          li.querySelector('[data-field="affinity"]').textContent = p.affinity;
          li.querySelector('[data-field="hit"]').textContent = p.hit;
          li.querySelector('[data-field="errors"]').textContent = p.errors;
          var sv = li.querySelector('[data-field="serving"]');
          sv.textContent = p.serving === 0 ? "no node serving: every request to this pool fails (502)"
            : p.serving + " of " + p.nodes + " nodes serving";
          sv.className = p.serving === 0 ? "bad" : "";
        });
        var gw = document.getElementById("gateway-status");
        if (gw) { gw.textContent = "gateway " + (data.gateway_ok ? "up" : "unreachable"); gw.className = data.gateway_ok ? "ok" : "bad"; }
        var table = document.getElementById("fleet");
        if (table) table.classList.remove("stale");
        var st = document.getElementById("refresh-status");
        if (st) st.textContent = "Live: updated " + new Date(data.at * 1000).toLocaleTimeString() + " (every 2 s).";
      })
      .catch(function (err) {
        var st = document.getElementById("refresh-status");
        if (st) st.textContent = "Live refresh failed (" + err.message + "): the figures below are stale; retrying.";
        var gw = document.getElementById("gateway-status");
        if (gw) { gw.textContent = "control plane unreachable"; gw.className = "bad"; }
        var table = document.getElementById("fleet");
        if (table) table.classList.add("stale");
      })
      .finally(function () { refreshing = false; });
  }

  // ------------------------------------------------------------------- charts
  var charts = {}, WINDOW_S = 900;
  window.addEventListener("resize", function () {
    Object.keys(charts).forEach(function (id) {
      var el = document.getElementById(id);
      if (el) charts[id].setSize({ width: Math.max(280, el.clientWidth || 320), height: 120 });
    });
  });
  function chartOpts(el, label, pct) {
    return {
      width: Math.max(280, el.clientWidth || 320), height: 120,
      legend: { show: false }, cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true, range: function () { var now = Date.now() / 1000; return [now - WINDOW_S, now]; } }, y: pct ? { range: [0, 100] } : { range: function (u, min, max) { return [0, Math.max(1, max)]; } } },
      axes: [{ space: 60, size: 26 }, { size: 48, values: function (u, vals) { return vals.map(function (v) { return pct ? v + "%" : v; }); } }],
      series: [{}, { label: label, stroke: pct ? "#1f5fbf" : "#b35a00", width: 1.5, spanGaps: false,
        fill: pct ? "rgba(31,95,191,.08)" : "rgba(179,90,0,.08)",
        value: function (u, v) { return v == null ? "—" : (pct ? v.toFixed(1) + "%" : v.toFixed(0)); } }]
    };
  }
  function refreshCharts() {
    var els = document.querySelectorAll(".chart[data-node]");
    if (!els.length) return;
    if (typeof window.uPlot !== "function") {
      var note = document.getElementById("charts-note");
      if (note) note.textContent = "The chart library (static/vendor/uPlot.iife.min.js) is missing: run `make setup`.";
      return;
    }
    fetch("/admin/history.json", { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (resp) { return resp.json(); })
      .then(function (data) {
        WINDOW_S = data.window_s || WINDOW_S;
        els.forEach(function (el) {
          var s = (data.nodes || {})[el.dataset.node];
          if (!s) return;
          var pct = el.dataset.series === "prefix_hit_ratio";
          var ys = (s[el.dataset.series] || []).map(function (v) { return v == null ? null : (pct ? 100 * v : v); });
          var d = [s.t || [], ys];
          if (charts[el.id]) { charts[el.id].setData(d); return; }
          charts[el.id] = new window.uPlot(chartOpts(el, pct ? "prefix-cache hit %" : "queue (waiting)", pct), d, el);
          el.dataset.ready = "1";
        });
      })
      .catch(function () { /* the table shows the failure; charts retry on the next round */ });
  }

  // ------------------------------------------------------------------- policy
  function watchPolicyEditor() {
    var ta = document.getElementById("policy-yaml"), apply = document.getElementById("policy-apply");
    var firstBad = document.querySelector("#annotated li.bad");
    if (firstBad) {  // bring the first bad line into view in the result panel, and the editor to it
      var panel = document.getElementById("check-result");
      panel.scrollTop = Math.max(0, firstBad.offsetTop - panel.offsetTop - panel.clientHeight / 3);
      var no = parseInt(firstBad.dataset.line, 10);
      if (ta && no > 0) {
        var lines = ta.value.split("\n"), pos = 0;
        for (var i = 0; i < no - 1 && i < lines.length; i++) pos += lines[i].length + 1;
        ta.setSelectionRange(pos, pos + (lines[no - 1] || "").length);
        ta.scrollTop = Math.max(0, (no - 5) * parseFloat(getComputedStyle(ta).lineHeight || "16"));
      }
    }
    if (!ta || !apply) return;
    var checked = ta.value;
    ta.addEventListener("input", function () {
      var changed = ta.value !== checked;
      apply.disabled = changed;
      apply.title = changed ? "The text changed since the check: check it again first." : "";
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    watchPolicyEditor();
    if (document.getElementById("fleet")) {
      refreshFleet();
      setInterval(refreshFleet, REFRESH_MS);
      refreshCharts();
      setInterval(refreshCharts, CHART_MS);
    }
  });
})();
