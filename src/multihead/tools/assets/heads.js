
/* multihead attention viewer: head view, model view, role table.
   All data comes from the JSON block above; every string from it is inserted
   with textContent or as an attribute value, never parsed as HTML.
   The script is longer than the house's 500 lines because the three views share one
   closure's state (the layer, heads and pinned token shown) instead of page globals,
   and the page's content-security policy admits exactly this one script by its hash. */
(() => {
  "use strict";
  const DATA = JSON.parse(document.getElementById("mh-data").textContent);
  const $ = (id) => document.getElementById(id);
  const LAYERS = DATA.layers, QT = DATA.query_tokens, KT = DATA.key_tokens;
  const QL = DATA.query_labels || QT, KL = DATA.key_labels || KT;  /* readable forms: "\u0120the" as "\u2423the" */
  const ROW = 22, MIN_LINK = 160, MAX_LINK = 800;
  let LINK_W = 240;
  const HEAD_COLORS = ["#2f6fdf", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#0b7285",
    "#5c940d", "#e67700", "#364fc7", "#a61e4d", "#087f5b", "#5f3dc4"];
  const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const svg = $("hv-lines"), SVG_NS = svg.namespaceURI, canvas = $("hv-canvas");
  /* heads: the heads drawn (one colour each); head: the one the selects and the model view point at;
     pin: a clicked token whose links stay shown ({side, index}) */
  const state = { layer: 0, head: 0, heads: [0], threshold: Number($("hv-threshold").value), pin: null };
  let queryEls = [], keyEls = [], linesByQuery = [], linesByKey = [];

  const roleOf = new Map();
  for (const r of DATA.roles || []) roleOf.set(r.row + ":" + r.head, r);
  const role = (layer, head) => roleOf.get(layer + ":" + head);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function shown(token) {
    const s = String(token).replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
    return s === "" ? "\u2205" : s;
  }
  const plural = (n, word) => n + " " + word + (n === 1 ? "" : "s");

  function fmt(x) {
    if (x === null || x === undefined) return "-";  /* not measurable, as the legend says */
    return Math.abs(x) >= 100 ? x.toFixed(0) : x.toFixed(Math.abs(x) >= 10 ? 1 : 2);
  }

  function ramp(w) {
    const v = Math.sqrt(Math.min(1, Math.max(0, w || 0))) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(v)), f = v - i;
    return RAMP[i].map((a, c) => Math.round(a + (RAMP[i + 1][c] - a) * f));
  }

  function rgba(hex, alpha) {
    const n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16) + "," + ((n >> 8) & 255) + "," + (n & 255) + "," + alpha.toFixed(3) + ")";
  }

  /* Text on a coloured background: white or black, whichever contrasts more by WCAG's
     relative luminance; one of the two always reaches 4.58:1 or more. */
  function luminance(rgb) {
    const c = rgb.map((v) => { v /= 255; return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
  }
  function textOn(rgb) {
    const L = luminance(rgb);
    return 1.05 / (L + 0.05) > (L + 0.05) / 0.05 ? "#ffffff" : "#000000";
  }
  function over(hex, alpha, base) {  /* colour hex at alpha over an opaque base [r, g, b] */
    const n = parseInt(hex.slice(1), 16), c = [n >> 16, (n >> 8) & 255, n & 255];
    return c.map((v, i) => Math.round(alpha * v + (1 - alpha) * base[i]));
  }

  function chipColor(label) {
    let h = 7;
    for (let i = 0; i < label.length; i++) h = (h * 31 + label.charCodeAt(i)) % 360;
    return "hsl(" + h + ", 70%, 88%)";
  }

  function chips(labels) {
    const box = el("span", "role-chips");
    for (const label of labels || []) {
      const chip = el("span", "role-chip", label);
      chip.style.backgroundColor = chipColor(label);
      box.appendChild(chip);
    }
    return box;
  }

  /* "Layer 4"; "Call 2 (layer 0)" only when a layer was called more than once (a generation loop) */
  const REPEATED = LAYERS.some((L, i) => LAYERS.findIndex((M) => M.layer === L.layer) !== i);
  function layerName(i) {
    if (DATA.row_titles) return DATA.row_titles[i];
    const L = LAYERS[i];
    return REPEATED ? "Call " + i + " (layer " + L.layer + ")" : "Layer " + L.layer;
  }

  /* ---- head view ---- */
  function tokenColumn(column, tokens, labels, side) {
    column.replaceChildren();
    return tokens.map((tok, i) => {
      const node = el("div", "hv-token", shown(labels[i]));
      node.dataset.side = side;
      node.dataset.index = String(i);
      node.title = String(tok);  /* the raw token, as the tokenizer wrote it */
      node.tabIndex = 0;
      node.addEventListener("mouseenter", () => { if (!state.pin) focusToken(side, i); });
      node.addEventListener("focus", () => { if (!state.pin) focusToken(side, i); });
      node.addEventListener("mouseleave", () => { if (!state.pin) clearFocus(); });
      node.addEventListener("blur", () => { if (!state.pin) clearFocus(); });
      node.addEventListener("click", () => pin(side, i));
      node.addEventListener("keydown", (e) => {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); pin(side, i); }
      });
      column.appendChild(node);
      return node;
    });
  }

  /* Click a token: its links stay shown (hovering others changes nothing) until it is clicked
     again, another token is clicked, or Escape is pressed. */
  function pin(side, index) {
    const same = state.pin && state.pin.side === side && state.pin.index === index;
    state.pin = same ? null : { side: side, index: index };
    if (state.pin) focusToken(side, index); else clearFocus();
  }

  function headColor(h) { return HEAD_COLORS[h % HEAD_COLORS.length]; }

  /* The link area takes the width the panel leaves beside the two token columns. */
  function fitLinks() {
    const free = $("head-view").clientWidth - 40 - $("hv-queries").offsetWidth - $("hv-keys").offsetWidth;
    const width = Math.max(MIN_LINK, Math.min(MAX_LINK, Math.floor(free)));
    if (width === LINK_W) return false;
    LINK_W = width;
    canvas.style.setProperty("--link-w", width + "px");
    return true;
  }

  function drawHead() {
    clearFocus();
    const n = Math.max(QT.length, KT.length), weights = LAYERS[state.layer].weights;
    linesByQuery = QT.map(() => []);
    linesByKey = KT.map(() => []);
    svg.setAttribute("width", String(LINK_W));
    svg.setAttribute("height", String(n * ROW));
    svg.setAttribute("viewBox", "0 0 " + LINK_W + " " + n * ROW);
    const frag = document.createDocumentFragment();
    let count = 0;
    for (const h of state.heads) {
      const W = weights[h], color = headColor(h);
      for (let i = 0; i < QT.length; i++) {
        for (let j = 0; j < KT.length; j++) {
          const w = W[i][j] || 0;
          if (w <= 0 || w < state.threshold) continue;
          const line = document.createElementNS(SVG_NS, "line");
          line.setAttribute("x1", "2");
          line.setAttribute("y1", String((i + 0.5) * ROW));
          line.setAttribute("x2", String(LINK_W - 2));
          line.setAttribute("y2", String((j + 0.5) * ROW));
          line.setAttribute("stroke", color);
          line.setAttribute("stroke-opacity", Math.min(1, 0.05 + 0.95 * Math.sqrt(w)).toFixed(3));
          line.setAttribute("stroke-width", (0.5 + 3.5 * w).toFixed(2));
          line.setAttribute("class", "hv-line");
          line.dataset.q = String(i);
          line.dataset.k = String(j);
          line.dataset.head = String(h);
          line.dataset.weight = String(w);
          linesByQuery[i].push(line);
          linesByKey[j].push(line);
          frag.appendChild(line);
          count++;
        }
      }
    }
    svg.replaceChildren(frag);
    svg.dataset.lines = String(count);
    $("hv-count").textContent = plural(count, "link");

    const L = LAYERS[state.layer], single = state.heads.length === 1, r = single ? role(state.layer, state.head) : null;
    const view = $("head-view");
    view.dataset.layer = String(state.layer);
    view.dataset.head = String(state.head);
    view.dataset.heads = state.heads.join(",");
    const H = weights.length;
    $("hv-title").textContent = layerName(state.layer) + " \u00b7 " + (single ? "Head " + state.head
      : state.heads.length === H ? "all " + H + " heads" : "Heads " + state.heads.join(", "));
    $("hv-subtitle").textContent = [L.name, L.kind].filter(Boolean).join(" \u00b7 ");
    const rolesBox = $("hv-roles");
    rolesBox.replaceChildren();
    if (r) {
      rolesBox.appendChild(r.labels.length ? chips(r.labels) : el("span", "role-chips", "no role \u00b7"));
      const scores = Object.entries(r.scores).filter(([, v]) => v !== null);
      rolesBox.appendChild(el("span", "", scores.map(([k, v]) => k + " " + meanText(r, k, v)).join(" \u00b7 ")));
    } else if (!single) {
      rolesBox.appendChild(el("span", "", "Each head in its colour; hover or click a token for the largest weight " +
        "any shown head gives, in that head's colour."));
    }
    $("hv-layer").value = String(state.layer);
    fillHeads();
    if (state.pin) focusToken(state.pin.side, state.pin.index);
    for (const node of document.querySelectorAll(".mv-cell.selected, #role-table tr.selected")) {
      node.classList.remove("selected");
      if (node.tagName === "BUTTON") node.setAttribute("aria-pressed", "false");
    }
    const sel = '[data-layer="' + state.layer + '"][data-head="' + state.head + '"]';
    for (const node of document.querySelectorAll(".mv-cell" + sel + ", #role-table tr" + sel)) {
      node.classList.add("selected");
      if (node.tagName === "BUTTON") node.setAttribute("aria-pressed", "true");
    }
  }

  function focusToken(side, index) {
    clearFocus();
    const weights = LAYERS[state.layer].weights;
    canvas.classList.add("hv-focus");
    canvas.dataset.focus = side + ":" + index;
    if (state.pin) canvas.dataset.pinned = state.pin.side + ":" + state.pin.index;
    (side === "query" ? queryEls : keyEls)[index].classList.add("hv-hot");
    if (state.pin) (side === "query" ? queryEls : keyEls)[index].classList.add("hv-pinned");
    for (const line of (side === "query" ? linesByQuery : linesByKey)[index]) line.classList.add("hv-active");
    const others = side === "query" ? keyEls : queryEls;
    others.forEach((node, o) => {
      let w = 0, color = headColor(state.heads[0]);
      for (const h of state.heads) {  /* the largest weight of the heads shown, in that head's colour */
        const v = side === "query" ? weights[h][index][o] : weights[h][o][index];
        if (v > w) { w = v; color = headColor(h); }
      }
      if (!(w > 0)) return;
      const alpha = Math.min(0.85, 0.1 + 0.9 * Math.sqrt(w));
      node.style.backgroundColor = rgba(color, alpha);
      node.style.color = textOn(over(color, alpha, [255, 255, 255]));  /* the panel is white */
      node.dataset.weight = w.toFixed(2);
    });
  }

  function clearFocus() {
    canvas.classList.remove("hv-focus");
    delete canvas.dataset.focus;
    delete canvas.dataset.pinned;
    for (const line of svg.querySelectorAll(".hv-active")) line.classList.remove("hv-active");
    for (const node of queryEls.concat(keyEls)) {
      node.classList.remove("hv-hot", "hv-pinned");
      node.style.backgroundColor = "";
      node.style.color = "";
      delete node.dataset.weight;
    }
  }

  function select(layer, head, reveal) {
    if (reveal && $("head-view").hidden) {  /* a model view alone: a clicked cell opens the head view */
      $("head-view").hidden = false;
      fitLinks();
    }
    state.layer = layer;
    state.head = Math.min(head, LAYERS[layer].weights.length - 1);
    state.heads = [state.head];
    drawHead();
    if (reveal) {
      const box = $("head-view").getBoundingClientRect();
      if (box.top < 0 || box.top > window.innerHeight - 80) $("head-view").scrollIntoView({ block: "start" });
      fitFrame();
    }
  }

  /* In a notebook the page is an iframe's srcdoc (tools.views): the frame grows to the page's height. */
  function fitFrame() {
    let frame = null;
    try { frame = window.frameElement; } catch (e) { return; }
    if (!frame || frame.dataset.mhView === undefined) return;
    const height = Math.ceil(document.body.getBoundingClientRect().height) + 2;
    if (Math.abs(frame.getBoundingClientRect().height - height) > 1) frame.style.height = height + "px";
  }

  /* The Head select (one head, or all of them) and one coloured toggle per head of the layer. */
  function fillHeads() {
    const box = $("hv-head"), H = LAYERS[state.layer].weights.length, toggles = $("hv-heads");
    if (box.options.length !== H + 2) {
      box.replaceChildren();
      for (let h = 0; h < H; h++) box.appendChild(new Option("Head " + h, String(h)));
      box.appendChild(new Option("All heads", "all"));
      const some = new Option("Chosen heads", "some");
      some.disabled = true;
      box.appendChild(some);
      toggles.replaceChildren();
      for (let h = 0; h < H; h++) {
        const button = el("button", "hv-head-toggle", String(h));
        button.type = "button";
        button.dataset.head = String(h);
        button.style.setProperty("--head", headColor(h));
        button.addEventListener("click", () => toggleHead(h));
        toggles.appendChild(button);
      }
    }
    box.value = state.heads.length === 1 ? String(state.head) : state.heads.length === H ? "all" : "some";
    for (const button of toggles.children) {
      const on = state.heads.includes(Number(button.dataset.head));
      button.setAttribute("aria-pressed", String(on));
      const r = role(state.layer, Number(button.dataset.head));
      button.title = "Head " + button.dataset.head + (r && r.labels.length ? ": " + r.labels.join(", ") : "") +
        (on ? " (shown; click to hide)" : " (click to show it too)");
    }
  }

  /* A toggle adds its head to the drawing or takes it away; the last head shown stays. */
  function toggleHead(h) {
    const i = state.heads.indexOf(h);
    if (i >= 0 && state.heads.length === 1) return;
    if (i >= 0) state.heads.splice(i, 1); else state.heads.push(h);
    state.heads.sort((a, b) => a - b);
    state.head = state.heads.includes(state.head) ? state.head : state.heads[0];
    drawHead();
  }

  function showAll() {
    state.heads = LAYERS[state.layer].weights.map((_, h) => h);
    drawHead();
  }

  /* ---- model view ---- */
  function paint(target, W) {
    const T = W.length, S = W[0].length;
    target.width = S;
    target.height = T;
    const ctx = target.getContext("2d"), img = ctx.createImageData(S, T);
    for (let i = 0; i < T; i++) {
      for (let j = 0; j < S; j++) {
        const [r, g, b] = ramp(W[i][j]), p = 4 * (i * S + j);
        img.data[p] = r; img.data[p + 1] = g; img.data[p + 2] = b; img.data[p + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  /* A pruned model (DATA.slots): every layer drawn with the heads it had, removed ones greyed. */
  const SLOTS = DATA.slots || null;
  function slotsOf(li) {
    if (SLOTS) return SLOTS.layers[li];
    return LAYERS[li].weights.map((_, h) => ({ head: h, original: null }));
  }

  function prunedCell(li, slot) {
    const name = SLOTS.original ? "head " + slot.original + " (before pruning)" : "a head";
    const cell = el("div", "mv-pruned");
    cell.dataset.layer = String(li);
    cell.dataset.slot = String(slot.original === null ? "" : slot.original);
    cell.title = layerName(li) + ": " + name + " was pruned";
    cell.append(el("div", "mv-heat mv-gone"), el("span", "mv-label", "pruned"));
    return cell;
  }

  const MAX_HEADS = SLOTS ? SLOTS.num_heads : Math.max(...LAYERS.map((L) => L.weights.length));
  /* Cells shrink (96 px down to 48 px) until every head of a layer fits the panel's width; with more
     heads than that the grid scrolls sideways and says so. */
  function fitCells() {
    const grid = $("mv-grid"), head = grid.querySelector(".mv-rowhead");
    const free = grid.clientWidth - (head ? head.offsetWidth : 80) - 8 * MAX_HEADS - 2;
    const cell = Math.max(48, Math.min(96, Math.floor(free / MAX_HEADS)));
    grid.style.setProperty("--cell", cell + "px");
    grid.classList.toggle("mv-small", cell < 72);
    $("mv-scroll").hidden = grid.scrollWidth <= grid.clientWidth + 1;
  }

  function buildModelView() {
    const grid = $("mv-grid"), maxHeads = MAX_HEADS;
    grid.style.gridTemplateColumns = "max-content repeat(" + maxHeads + ", var(--cell))";
    grid.appendChild(el("div", "mv-corner"));
    const colName = SLOTS && SLOTS.original ? "before: H" : "Head ";
    for (let h = 0; h < maxHeads; h++) grid.appendChild(el("div", "mv-colhead", colName + h));
    LAYERS.forEach((L, li) => {
      const head = el("div", "mv-rowhead");
      head.appendChild(el("strong", "", layerName(li)));
      head.appendChild(document.createTextNode(L.kind || ""));
      grid.appendChild(head);
      const slots = slotsOf(li);
      for (let s = 0; s < maxHeads; s++) {
        if (s >= slots.length) { grid.appendChild(el("div", "mv-empty")); continue; }
        if (slots[s].head === null) { grid.appendChild(prunedCell(li, slots[s])); continue; }
        const h = slots[s].head, was = slots[s].original;
        const r = role(li, h), cell = el("button", "mv-cell");
        cell.type = "button";
        cell.dataset.layer = String(li);
        cell.dataset.head = String(h);
        cell.setAttribute("aria-pressed", "false");
        cell.title = layerName(li) + ", head " + h + (was !== null ? " (head " + was + " before pruning)" : "") +
          (r && r.labels.length ? ": " + r.labels.join(", ") : "");
        const heat = el("canvas", "mv-heat");
        paint(heat, L.weights[h]);
        const label = el("span", "mv-label");
        label.appendChild(el("b", "", "H" + h));
        if (was !== null && was !== h) label.appendChild(el("span", "mv-was", "was H" + was));
        if (r) label.appendChild(chips(r.labels));
        if (r && r.scores.importance !== undefined && r.scores.importance !== null) {
          label.appendChild(el("span", "mv-importance", "importance " + r.scores.importance.toFixed(4)));
        }
        cell.append(heat, label);
        cell.addEventListener("click", () => select(li, h, true));
        grid.appendChild(cell);
      }
    });
  }

  /* ---- role table ---- */
  const MAIN_SCORES = ["previous", "next", "self", "cls", "sep", "punct", "broad", "rare", "entropy", "distance"];
  const FIXED_COLUMNS = {
    layer: "the layer (or the call, when a layer runs more than once) the head belongs to",
    head: "the head's index in its layer",
    roles: "the roles whose score reached its threshold and beat chance by the margin; none: no role",
  };
  const table = { rows: [], sort: null };

  /* Roles over a corpus carry each score's spread and evidence: "0.62 \u00b1 0.08", a "*" where the
     evidence is too thin for a role, and a tooltip with the counts and the 95% interval of the mean. */
  function meanText(r, k, v) {
    const sd = r.spread && r.spread[k], ev = r.evidence && r.evidence[k];
    return fmt(v) + (sd === null || sd === undefined ? "" : " \u00b1 " + fmt(sd)) + (ev && ev.enough === false ? "*" : "");
  }
  function evidenceTitle(r, k) {
    const ev = r.evidence && r.evidence[k];
    if (!ev) return "";
    const iv = r.interval && r.interval[k];
    return "mean over " + plural(ev.texts, "text") + " (" + plural(ev.rows, "query row") +
      (ev.keys === null || ev.keys === undefined ? "" : ", " + plural(ev.keys, "key token")) + ")" +
      (iv ? "; 95% interval of the mean " + fmt(iv[0]) + " to " + fmt(iv[1]) : "") +
      (ev.enough === false ? "; too little evidence for the role" : "");
  }

  function columnTitle(name) {
    if (name === "roles" && DATA.legend && DATA.legend.roles) return DATA.legend.roles.meaning;
    if (FIXED_COLUMNS[name]) return FIXED_COLUMNS[name];
    const entry = DATA.legend && DATA.legend[name];
    if (!entry) return name;
    const t = entry.threshold;
    return entry.meaning + (t === null || t === undefined ? " (no role)" : "; a role when \u2265 " + t.toFixed(2));
  }

  function sortKey(r, name) {
    if (name === "layer") return [r.row, r.head];
    if (name === "head") return [r.head, r.row];
    if (name === "roles") return r.labels.length ? [r.labels.join(",")] : [null];
    if (name === "texts") return [r.texts === undefined ? null : r.texts];
    const v = r.scores[name];
    return [v === null || v === undefined ? null : v];
  }

  function compareKeys(a, b, dir) {
    for (let i = 0; i < a.length; i++) {
      if (a[i] === b[i]) continue;
      if (a[i] === null) return 1;  /* missing scores last, whatever the direction */
      if (b[i] === null) return -1;
      return (a[i] < b[i] ? -1 : 1) * dir;
    }
    return 0;
  }

  function sortBy(name) {
    const numeric = !(name in FIXED_COLUMNS);
    const first = numeric ? "descending" : "ascending";
    const dir = table.sort && table.sort.name === name ? (table.sort.dir === "ascending" ? "descending" : "ascending") : first;
    table.sort = { name: name, dir: dir };
    const sign = dir === "ascending" ? 1 : -1;
    const order = table.rows.slice().sort((a, b) =>
      compareKeys(sortKey(a.r, name), sortKey(b.r, name), sign) || a.r.row - b.r.row || a.r.head - b.r.head);
    const body = document.querySelector("#role-table tbody");
    for (const item of order) body.appendChild(item.tr);
    for (const th of document.querySelectorAll("#role-table th")) {
      if (th.dataset.column === name) th.setAttribute("aria-sort", dir);
      else th.removeAttribute("aria-sort");
    }
  }

  /* The legend: "roles" (the rule and the two marks) when given, then the table's columns in its
     order, then the scores only the head view shows (*_mass). */
  function buildLegend(cols, extra) {
    const box = $("role-legend");
    if (!DATA.legend) return;
    if (DATA.legend.roles) box.append(el("dt", "", "roles"), el("dd", "", DATA.legend.roles.meaning));
    for (const name of cols.concat(extra)) {
      const entry = DATA.legend[name];
      if (!entry) continue;
      const t = entry.threshold;
      const term = el("dt", "", name);
      term.appendChild(el("span", "legend-rule", t === null || t === undefined ? "no role" : "\u2265 " + t.toFixed(2)));
      const meaning = el("dd", "", entry.meaning);
      if (!cols.includes(name)) meaning.appendChild(el("span", "muted", " (head view only, not in the table)"));
      box.append(term, meaning);
    }
    box.hidden = !box.children.length;
  }

  /* One greyed row per removed head, after its layer's kept heads; it sorts with missing scores. */
  function addPrunedRows(body, cols) {
    LAYERS.forEach((L, li) => {
      for (const slot of SLOTS.layers[li]) {
        if (slot.head !== null) continue;
        const r = { row: li, layer: L.layer, head: null, labels: [], scores: {} };
        const tr = el("tr", "rt-row rt-pruned");
        tr.dataset.layer = String(li);
        tr.appendChild(el("td", "", REPEATED ? li + " (" + L.layer + ")" : L.layer));
        tr.appendChild(el("td", "", slot.original === null ? "\u2013" : "was " + slot.original));
        tr.appendChild(el("td", "", "pruned"));
        if (CORPUS) tr.appendChild(el("td", "num", "\u2013"));
        for (const k of cols) {
          const td = el("td", "num", k === "importance" ? "pruned" : "\u2013");
          td.dataset.column = k;
          tr.appendChild(td);
        }
        const last = table.rows.filter((item) => item.r.row <= li).pop();
        body.insertBefore(tr, last ? last.tr.nextSibling : body.firstChild);
        table.rows.splice(last ? table.rows.indexOf(last) + 1 : 0, 0, { r: r, tr: tr });
      }
    });
  }

  const CORPUS = (DATA.roles || []).some((r) => r.evidence);

  function buildRoles() {
    const list = DATA.roles;
    if (!list || !list.length) return;
    $("roles").hidden = false;
    const keys = [];
    for (const r of list) for (const k of Object.keys(r.scores)) if (!keys.includes(k)) keys.push(k);
    let cols = MAIN_SCORES.filter((k) => keys.includes(k));
    cols = cols.concat(keys.filter((k) => !cols.includes(k) && !k.endsWith("_mass")));
    const headRow = el("tr");
    for (const name of ["layer", "head", "roles"].concat(CORPUS ? ["texts"] : [], cols)) {
      const th = el("th");
      th.dataset.column = name;
      th.title = columnTitle(name);
      th.scope = "col";
      const button = el("button", "sort", name);
      button.type = "button";
      button.addEventListener("click", () => sortBy(name));
      th.appendChild(button);
      headRow.appendChild(th);
    }
    document.querySelector("#role-table thead").appendChild(headRow);
    const body = document.querySelector("#role-table tbody");
    const rows = list.slice().sort((a, b) => a.row - b.row || a.head - b.head);
    for (const r of rows) {
      const tr = el("tr", "rt-row");
      tr.dataset.layer = String(r.row);
      tr.dataset.head = String(r.head);
      tr.appendChild(el("td", "", REPEATED ? r.row + " (" + r.layer + ")" : r.layer));
      const was = SLOTS ? SLOTS.layers[r.row].findIndex((s) => s.head === r.head) : -1;
      tr.appendChild(el("td", "", SLOTS && SLOTS.original && was !== r.head ? r.head + " (was " + was + ")" : r.head));
      const labels = el("td");
      labels.appendChild(r.labels.length ? chips(r.labels) : el("span", "muted", "none"));
      if (r.withheld && r.withheld.length) {
        const held = el("span", "muted withheld", " (" + r.withheld.join(", ") + ")");
        held.title = "passed on the mean, withheld: too little evidence";
        labels.appendChild(held);
      }
      tr.appendChild(labels);
      if (CORPUS) tr.appendChild(el("td", "num", r.texts));
      for (const k of cols) {
        const thin = r.evidence && r.evidence[k] && r.evidence[k].enough === false;
        const td = el("td", "num" + (r.labels.includes(k) ? " hit" : "") + (thin ? " thin" : ""),
          CORPUS ? meanText(r, k, r.scores[k]) : fmt(r.scores[k]));
        td.dataset.column = k;
        if (CORPUS) td.title = evidenceTitle(r, k);
        tr.appendChild(td);
      }
      tr.addEventListener("click", () => select(r.row, r.head, true));
      body.appendChild(tr);
      table.rows.push({ r: r, tr: tr });
    }
    if (SLOTS) addPrunedRows(body, cols);
    buildLegend((CORPUS ? ["texts"] : []).concat(cols), keys.filter((k) => k.endsWith("_mass")));
  }

  /* ---- a causal model's roles: each role's heads at or above its threshold, strongest first, then
     every head's scores; a head opens in the head view (its weights on the text) ---- */
  const rowOfLayer = (layer) => LAYERS.findIndex((L) => L.layer === layer);

  function causalHead(tr, layer, head) {
    const row = rowOfLayer(layer);
    if (row < 0) { tr.disabled = true; return; }  /* --layer: that layer's weights on the text were not captured */
    tr.addEventListener("click", () => select(row, head, true));
  }

  function buildCausal() {
    const C = DATA.causal;
    if (!C || !C.roles.length) return;
    $("causal").hidden = false;
    $("causal-subtitle").textContent = plural(C.batch, "sequence") + " of " + C.length + " random tokens, each " +
      "repeated; a head has a role when its score reaches the threshold (chance: an even spread, 0 for copying). " +
      "Click a head to open it on the text.";
    for (const role of C.roles) {
      const found = [];
      C.scores[role.name].forEach((r, li) => r.forEach((v, h) => { if (v !== null && v >= role.threshold) found.push([v, li, h]); }));
      found.sort((a, b) => b[0] - a[0] || a[1] - b[1] || a[2] - b[2]);
      const item = el("li", "causal-role"), name = el("span", "causal-name", role.name);
      item.dataset.role = role.name;
      name.title = role.meaning;
      item.append(name, el("span", "legend-rule", "\u2265 " + role.threshold.toFixed(2)),
        el("span", "muted", "chance " + fmt(role.chance) + " \u00b7 " + plural(found.length, "head")));
      if (!found.length) {  /* the head that came closest, as the printout names it */
        let best = null;
        C.scores[role.name].forEach((r, li) => r.forEach((v, h) => { if (v !== null && (!best || v > best[0])) best = [v, li, h]; }));
        if (best) item.appendChild(el("span", "muted", "closest: L" + best[1] + " H" + best[2] + " " + fmt(best[0])));
      }
      for (const [v, li, h] of found) {
        const button = el("button", "causal-head", "L" + li + " H" + h + " " + fmt(v));
        button.type = "button";
        causalHead(button, li, h);
        item.appendChild(button);
      }
      $("causal-roles").appendChild(item);
    }
    const headRow = el("tr");
    for (const name of ["layer", "head"].concat(C.roles.map((r) => r.name))) {
      const th = el("th", "", name), role = C.roles.find((r) => r.name === name);
      th.scope = "col";
      if (role) th.title = role.meaning + "; a role when \u2265 " + role.threshold.toFixed(2);
      headRow.appendChild(th);
    }
    document.querySelector("#causal-table thead").appendChild(headRow);
    const body = document.querySelector("#causal-table tbody"), first = C.scores[C.roles[0].name];
    first.forEach((r, li) => r.forEach((v0, h) => {
      if (v0 === null) return;  /* the layer has fewer heads */
      const tr = el("tr");
      tr.append(el("td", "", li), el("td", "", h));
      for (const role of C.roles) {
        const v = C.scores[role.name][li][h];
        tr.appendChild(el("td", "num" + (v !== null && v >= role.threshold ? " hit" : ""), fmt(v)));
      }
      causalHead(tr, li, h);
      body.appendChild(tr);
    }));
    const notes = $("causal-notes");
    for (const text of C.notes || []) notes.appendChild(el("p", "notice", text));
    notes.hidden = !notes.children.length;
  }

  /* ---- wiring ---- */
  function init() {
    const H = LAYERS.map((L) => L.weights.length), same = H.every((h) => h === H[0]);
    const layers = REPEATED ? plural(LAYERS.length, "call") : LAYERS.length === 1 ? "layer " + LAYERS[0].layer
      : plural(LAYERS.length, "layer");
    $("summary").textContent = [DATA.source, SLOTS ? SLOTS.summary : layers + " \u00d7 " + (same ? plural(H[0], "head")
      : "up to " + Math.max(...H) + " heads"), QT.length + (QT.length === 1 ? " query, " : " queries, ") +
      plural(KT.length, "key"), "batch item " + DATA.batch].filter(Boolean).join(" \u00b7 ");
    if (DATA.summary) $("summary").textContent = DATA.summary;
    const notes = $("notices");
    for (const text of DATA.notices || []) notes.appendChild(el("p", "notice", text));
    notes.hidden = !notes.children.length;
    LAYERS.forEach((L, i) => $("hv-layer").appendChild(new Option(layerName(i) + " (" + L.kind + ")", String(i))));
    queryEls = tokenColumn($("hv-queries"), QT, QL, "query");
    keyEls = tokenColumn($("hv-keys"), KT, KL, "key");
    $("hv-layer").addEventListener("change", (e) => {  /* the heads shown stay, where the layer has them */
      const layer = Number(e.target.value), H = LAYERS[layer].weights.length;
      const kept = state.heads.filter((h) => h < H);
      state.layer = layer;
      state.heads = kept.length ? kept : [Math.min(state.head, H - 1)];
      state.head = state.heads.includes(state.head) ? state.head : state.heads[0];
      drawHead();
    });
    $("hv-head").addEventListener("change", (e) => {
      if (e.target.value === "all") showAll(); else select(state.layer, Number(e.target.value), false);
    });
    $("hv-all").addEventListener("click", showAll);
    document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.pin) pin(state.pin.side, state.pin.index); });
    $("hv-threshold").addEventListener("input", (e) => {
      state.threshold = Number(e.target.value);
      $("hv-threshold-value").textContent = state.threshold.toFixed(2);
      drawHead();
    });
    if (DATA.sides) {
      document.querySelector(".hv-col-title.hv-left").textContent = DATA.sides[0];
      document.querySelector(".hv-col-title.hv-right").textContent = DATA.sides[1];
    }
    $("model-view").hidden = DATA.view === "head";
    if (DATA.view === "model") {  /* the grid first; the head view opens below it on a click */
      $("head-view").hidden = true;
      $("head-view").style.order = "1";
    }
    buildModelView();
    buildCausal();
    buildRoles();
    fitLinks();
    fitCells();
    const start = DATA.start || { row: 0, heads: [0] };
    select(start.row, start.heads[0], false);
    if (start.heads.length > 1) { state.heads = start.heads.slice(); drawHead(); }
    let pending = 0;
    window.addEventListener("resize", () => {
      cancelAnimationFrame(pending);
      pending = requestAnimationFrame(() => { fitCells(); if (fitLinks()) drawHead(); fitFrame(); });
    });
    fitFrame();
    document.body.dataset.ready = "true";
  }

  init();
})();
