/* kvgate admin, Costs page: the two charts (uPlot, vendored in static/vendor/) from /admin/costs.json —
 * cost per hour stacked by tenant (the report's series) and the four-quadrant scatter of the last hour's
 * requests (input tokens × cost, split at the medians). The tables are server-rendered and need no script. */
(function () {
  "use strict";
  var COLORS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00"];
  var note = document.getElementById("charts-note");
  if (typeof window.uPlot !== "function") {
    if (note) note.textContent = "The chart library (static/vendor/uPlot.iife.min.js) is missing: run `make setup`.";
    return;
  }
  function width(el) { return Math.max(300, el.clientWidth || 600); }
  function usd(v) { return v == null ? "—" : "$" + v.toFixed(6); }

  function stacked(el, rep) {
    var series = rep.series, keys = {};
    series.forEach(function (h) { Object.keys(h.by).forEach(function (k) { keys[k] = 1; }); });
    keys = Object.keys(keys).sort();
    // one bar per hour (the rollups' bucket), at the hour's middle; stacked: each tenant's bar is
    // the running sum, drawn from the tallest down so every smaller one stays visible
    var xs = series.map(function (h) { return h.hour + 1800; }), sums = [], run = xs.map(function () { return 0; });
    keys.forEach(function (k) {
      run = run.map(function (v, i) { return v + (series[i].by[k] || 0); });
      sums.push(run.slice());
    });
    var bars = window.uPlot.paths && window.uPlot.paths.bars ? window.uPlot.paths.bars({ size: [0.8, 60] }) : undefined;
    var order = keys.map(function (k, i) { return i; }).reverse();
    var s = [{}].concat(order.map(function (i) {
      var c = COLORS[i % COLORS.length];
      return { label: keys[i], stroke: c, fill: c + "cc", width: 1, paths: bars, points: { show: !bars },
               value: function (u, v, si, di) { return di == null ? "—" : usd(series[di].by[keys[i]] || 0); } };
    }));
    new window.uPlot({ width: width(el), height: 220, series: s,
      scales: { x: { time: true, range: [rep.since, Math.ceil(rep.until / 3600) * 3600] },
                y: { range: function (u, min, max) { return [0, max > 0 ? max * 1.1 : 1e-6]; } } },
      axes: [{}, { size: 80, values: function (u, v) { return v.map(function (x) { return "$" + x.toPrecision(2); }); } }]
    }, [xs].concat(order.map(function (i) { return sums[i]; })), el);
  }

  function scatter(el, q) {
    var pts = q.points.slice().sort(function (a, b) { return a[0] - b[0]; });
    var xs = pts.map(function (p) { return p[0]; }), mc = q.split.cost_usd, mt = q.split.tokens;
    // the "expensive and long" quadrant as its own series, drawn in red
    var hot = pts.map(function (p) { return p[0] > mt && p[1] > mc ? p[1] : null; });
    var rest = pts.map(function (p) { return p[0] > mt && p[1] > mc ? null : p[1]; });
    var none = function () { return null; };
    new window.uPlot({ width: width(el), height: 260,
      series: [{ label: "input tokens" },
               { label: "request", stroke: "#3366cc", paths: none, points: { show: true, size: 5, fill: "#3366cc" },
                 value: function (u, v) { return usd(v); } },
               { label: "expensive and long", stroke: "#dc3912", paths: none,
                 points: { show: true, size: 6, fill: "#dc3912" }, value: function (u, v) { return usd(v); } }],
      scales: { x: { time: false, range: function (u, min, max) { return [0, max * 1.05]; } },
               y: { range: function (u, min, max) { return [0, max * 1.1]; } } },
      axes: [{ label: "input tokens" }, { size: 96, values: function (u, v) { return v.map(function (x) { return "$" + x.toPrecision(2); }); } }],
      hooks: { draw: [function (u) {  // the median lines
        var c = u.ctx, x = u.valToPos(mt, "x", true), y = u.valToPos(mc, "y", true);
        c.save(); c.strokeStyle = "#888"; c.setLineDash([4, 4]); c.beginPath();
        c.moveTo(x, u.bbox.top); c.lineTo(x, u.bbox.top + u.bbox.height);
        c.moveTo(u.bbox.left, y); c.lineTo(u.bbox.left + u.bbox.width, y); c.stroke(); c.restore();
      }] }
    }, [xs, rest, hot], el);
  }

  fetch("/admin/costs.json" + location.search, { credentials: "same-origin", headers: { "Accept": "application/json" } })
    .then(function (resp) { if (!resp.ok) throw new Error("HTTP " + resp.status); return resp.json(); })
    .then(function (data) {
      var c = document.getElementById("chart-cost"), s = document.getElementById("chart-quadrants");
      if (c && data.report.series.length) stacked(c, data.report);
      else if (c && note) note.textContent = "No cost in this interval.";
      if (s && data.quadrants.n) scatter(s, data.quadrants);
      document.body.dataset.chartsReady = "1";
    })
    .catch(function (err) { if (note) note.textContent = "The charts could not be loaded: " + err.message; });
})();
