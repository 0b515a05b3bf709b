// The minivllm dashboard: reads /dashboard/events (Server-Sent Events) with fetch() streaming, so the
// API key can go in an Authorization header (EventSource cannot send one), and draws each payload.
// `window.dashboard` holds the page's state (the latest payload, block counts drawn): tests read it.
'use strict';
(() => {
  const $ = (selector) => document.querySelector(selector);
  const FREE = 0, CACHED = 1, USED = 2, SHARED = 3;
  const STATE_NAMES = ['free', 'cached (evictable)', 'in use', 'shared'];
  const FADE_MS = 4000;  // finished requests fade out over this long
  const KV_MAX_HEIGHT = 220;  // px; when one cell per block would be taller, cells aggregate blocks
  const MIN_STEP_SLOTS = 100;  // bars are this wide at least; the engine's log keeps 300 steps
  const KEY_ITEM = 'minivllm-api-key';

  const state = {payload: null, events: 0, connected: false, kv: null, drawn: null, layout: null,
                 rows: new Map(), faded: new Set()};
  window.dashboard = state;

  // ---- connection ---------------------------------------------------------------------------
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.has('key')) {  // /dashboard#key=KEY: the fragment never reaches the server or its logs
    sessionStorage.setItem(KEY_ITEM, hash.get('key'));
    history.replaceState(null, '', location.pathname + location.search);
  }

  function setStatus(text, kind) {
    const el = $('#status');
    el.textContent = text;
    el.dataset.kind = kind;
  }

  async function connect() {
    const key = sessionStorage.getItem(KEY_ITEM);
    setStatus('connecting…', 'connecting');
    let response;
    try {
      response = await fetch('dashboard/events', {cache: 'no-store', headers: key ? {Authorization: `Bearer ${key}`} : {}});
    } catch (err) {
      return retry();
    }
    if (response.status === 401) {
      setStatus(key ? 'wrong API key' : 'API key needed', 'error');
      $('#key-form').hidden = false;
      return;
    }
    if (!response.ok) return retry(`HTTP ${response.status}`);
    state.connected = true;
    setStatus('live', 'live');
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += value.replace(/\r/g, '');
        let end;
        while ((end = buffer.indexOf('\n\n')) >= 0) {
          const data = buffer.slice(0, end).split('\n').filter((line) => line.startsWith('data:'))
            .map((line) => line.slice(5).replace(/^ /, '')).join('\n');
          buffer = buffer.slice(end + 2);
          if (data) onPayload(JSON.parse(data));
        }
      }
    } catch (err) { /* the connection dropped: reconnect below */ }
    state.connected = false;
    retry();
  }

  function retry(reason) {
    setStatus(reason ? `${reason}, reconnecting…` : 'reconnecting…', 'error');
    setTimeout(connect, 2000);
  }

  $('#key-form').addEventListener('submit', (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $('#key').value);
    $('#key-form').hidden = true;
    connect();
  });

  // ---- formatting ---------------------------------------------------------------------------
  const fmtSeconds = (s) => s == null ? '–' : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
  const fmtRate = (x) => x == null ? '–' : x >= 100 ? x.toFixed(0) : x.toFixed(1);
  const fmtPercent = (x) => x == null ? '–' : `${(x * 100).toFixed(1)} %`;
  const fmtPair = (q) => {  // "120 · 480 ms", "1.20 · 2.48 s", "9.8 · 39.5 s": one unit, the p99's
    if (!q || q.p50 == null) return '–';
    if (q.p99 < 1) return `${Math.round(q.p50 * 1000)} · ${Math.round(q.p99 * 1000)} ms`;
    const digits = q.p99 < 10 ? 2 : 1;
    return `${q.p50.toFixed(digits)} · ${q.p99.toFixed(digits)} s`;
  };
  const cssVar = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  function decode(b64, bytesPerItem) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    return bytesPerItem === 1 ? bytes : bytesPerItem === 2 ? new Uint16Array(bytes.buffer) : new Uint32Array(bytes.buffer);
  }

  function setText(selector, text) {
    const el = $(selector);
    if (el.textContent !== text) el.textContent = text;
  }

  // ---- rendering ----------------------------------------------------------------------------
  function onPayload(payload) {
    state.payload = payload;
    state.events += 1;
    const e = payload.engine, m = payload.metrics;
    const kv = e.kv;
    state.kv = {state: decode(kv.state, 1), pos: decode(kv.pos, kv.pos_bytes), unknown: kv.pos_unknown,
                blockSize: kv.block_size, counts: {free: kv.free, cached: kv.cached, used: kv.used, shared: kv.shared}};
    setText('#model', `${payload.server.served_model_name} · ${kv.num_blocks} KV blocks of ${kv.block_size} tokens · ` +
            `${e.config.max_num_batched_tokens} tokens/step · ${e.config.max_num_seqs} seqs`);
    setText('#stat-running', String(e.num_running));
    setText('#stat-waiting', String(e.num_waiting));
    setText('#stat-kv', fmtPercent(kv.usage));
    setText('#stat-hit', fmtPercent(m.prefix_cache_hit_rate));
    setText('#stat-prompt-tps', fmtRate(m.prompt_tokens_per_s));
    setText('#stat-gen-tps', fmtRate(m.generation_tokens_per_s));
    setText('#stat-ttft', fmtPair(m.ttft));
    setText('#stat-tpot', fmtPair(m.tpot));
    setText('#stat-itl', fmtPair(m.itl));
    setText('#stat-preemptions', String(e.num_preemptions));
    setText('#kv-summary', `${kv.used} in use · ${kv.shared} shared · ${kv.cached} cached · ${kv.free} free`);
    setText('#footer', `snapshot every ${fmtSeconds(payload.server.snapshot_interval_s)}, ` +
            `taking ${(e.snapshot_seconds * 1000).toFixed(2)} ms of the step loop`);
    renderRequests(e);
    drawKV();
    drawSteps();
  }

  function renderRequests(e) {
    const now = performance.now();
    const tbody = $('#requests tbody');
    const order = [...e.requests, ...e.finished.filter((r) => !state.faded.has(r.id))];
    const seen = new Set();
    for (const r of order) {
      seen.add(r.id);
      let tr = state.rows.get(r.id);
      if (!tr) {
        tr = document.createElement('tr');
        tr.innerHTML = '<td class="id"></td><td><span class="badge"></span></td><td class="num prompt"></td>' +
          '<td class="num output"></td><td class="num queue"></td><td class="num ttft"></td>' +
          '<td class="num tps"></td><td class="num blocks"></td>';
        tr.cells[0].textContent = r.id.length > 22 ? `…${r.id.slice(-20)}` : r.id;
        tr.cells[0].title = r.id;
        state.rows.set(r.id, tr);
      }
      if (r.state === 'finished' && !tr.dataset.goneAt) tr.dataset.goneAt = String(now - r.age * 1000);
      tr.dataset.state = r.state;
      const label = r.state === 'prefilling' ? `prefill chunk ${r.chunk[0]} of ${r.chunk[1]}` :
        r.state === 'finished' ? `finished (${r.reason})` : r.state;
      tr.cells[1].firstChild.textContent = r.preemptions ? `${label} · ${r.preemptions}× preempted` : label;
      tr.cells[2].textContent = `${r.computed} / ${r.prompt}` + (r.cached ? ` (${r.cached} cached)` : '');
      tr.cells[3].textContent = r.kind === 'embed' ? 'embedding' : `${r.output} / ${r.max_tokens ?? '∞'}`;
      tr.cells[3].style.setProperty('--progress', `${r.max_tokens ? 100 * r.output / r.max_tokens : 0}%`);
      tr.cells[4].textContent = fmtSeconds(r.queue);
      tr.cells[5].textContent = fmtSeconds(r.ttft);
      tr.cells[6].textContent = fmtRate(r.tokens_per_s);
      tr.cells[7].textContent = String(r.blocks.length);
    }
    for (const [id, tr] of state.rows) {
      if (!seen.has(id) && !tr.dataset.goneAt) {  // aborted, or finished between two snapshots
        tr.dataset.goneAt = String(now);
        if (tr.dataset.state !== 'finished') {
          tr.dataset.state = 'gone';
          tr.cells[1].firstChild.textContent = 'gone';
        }
      }
    }
    // running, waiting, finished, then those gone from the snapshot
    for (const r of order) tbody.appendChild(state.rows.get(r.id));
    for (const [id, tr] of state.rows) if (!seen.has(id)) tbody.appendChild(tr);
    const listed = new Set(e.finished.map((r) => r.id));
    for (const id of state.faded) if (!listed.has(id)) state.faded.delete(id);
    fadeRows();
  }

  function fadeRows() {
    const now = performance.now();
    for (const [id, tr] of state.rows) {
      if (!tr.dataset.goneAt) continue;
      const left = 1 - (now - Number(tr.dataset.goneAt)) / FADE_MS;
      if (left <= 0) {
        tr.remove();
        state.rows.delete(id);
        state.faded.add(id);  // the snapshot may list it as finished a little longer
      } else {
        tr.style.opacity = String(Math.max(0.15, left));
      }
    }
    $('#no-requests').hidden = state.rows.size > 0;
  }
  setInterval(fadeRows, 250);

  function sizeCanvas(canvas, height) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.parentElement.clientWidth;
    canvas.style.height = `${height}px`;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext('2d');
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return [ctx, width];
  }

  // One cell per block while cells of at least 3 px fit KV_MAX_HEIGHT; beyond that each cell
  // stands for `per` consecutive blocks, coloured by their most common state (shared wins ties),
  // with a shared-coloured corner when any of them is shared.
  function drawKV() {
    const kv = state.kv;
    if (!kv) return;
    const canvas = $('#kv-map');
    const n = kv.state.length;
    const width = canvas.parentElement.clientWidth;
    let size = 3;
    for (const s of [32, 24, 20, 16, 14, 12, 10, 8, 6, 5, 4, 3]) {
      if (Math.ceil(n / Math.floor(width / s)) * s <= KV_MAX_HEIGHT) { size = s; break; }
    }
    const cols = Math.max(1, Math.floor(width / size));
    const per = Math.max(1, Math.ceil(n / (cols * Math.floor(KV_MAX_HEIGHT / size))));
    const cells = Math.ceil(n / per);
    const [ctx] = sizeCanvas(canvas, Math.ceil(cells / cols) * size);
    const colors = ['--free', '--cached', '--used', '--shared'].map(cssVar);
    const gap = size >= 6 ? 1 : 0;
    const drawn = [0, 0, 0, 0];
    for (let c = 0; c < cells; c++) {
      const counts = [0, 0, 0, 0];
      for (let b = c * per; b < Math.min(n, (c + 1) * per); b++) counts[kv.state[b]] += 1;
      let st = SHARED;
      for (let s = SHARED - 1; s >= FREE; s--) if (counts[s] > counts[st]) st = s;
      const x = (c % cols) * size, y = Math.floor(c / cols) * size;
      ctx.fillStyle = colors[st];
      ctx.fillRect(x, y, size - gap, size - gap);
      if (st !== SHARED && counts[SHARED]) {
        ctx.fillStyle = colors[SHARED];
        ctx.fillRect(x, y, Math.ceil(size / 2), Math.ceil(size / 2));
      }
      drawn[st] += 1;
    }
    state.layout = {size, cols, per, cells};
    state.drawn = {free: drawn[FREE], cached: drawn[CACHED], used: drawn[USED], shared: drawn[SHARED]};
  }

  function holders(blockId) {
    return state.payload.engine.requests.filter((r) => r.blocks.includes(blockId)).map((r) => r.id);
  }

  function describeCell(cell) {
    const {per} = state.layout, kv = state.kv;
    const first = cell * per, last = Math.min(kv.state.length, first + per) - 1;
    if (per > 1) {
      const counts = [0, 0, 0, 0];
      for (let b = first; b <= last; b++) counts[kv.state[b]] += 1;
      return `Blocks ${first}–${last}: ${counts[USED]} in use, ${counts[SHARED]} shared, ` +
        `${counts[CACHED]} cached, ${counts[FREE]} free`;
    }
    const owners = holders(first);
    let text = `Block ${first} · ${STATE_NAMES[kv.state[first]]}`;
    if (owners.length) text += ` · held by ${owners.join(', ')}` + (owners.length > 1 ? ` (ref ${owners.length})` : '');
    const pos = kv.pos[first];
    if (pos !== kv.unknown) {
      text += ` · hash-chain position ${pos} (tokens ${pos * kv.blockSize}–${(pos + 1) * kv.blockSize - 1})`;
    }
    return text;
  }

  const tooltip = $('#tooltip');
  $('#kv-map').addEventListener('mousemove', (event) => {
    if (!state.layout) return;
    const rect = event.target.getBoundingClientRect();
    const {size, cols, cells} = state.layout;
    const col = Math.floor((event.clientX - rect.left) / size), row = Math.floor((event.clientY - rect.top) / size);
    const cell = row * cols + col;
    if (col >= cols || cell >= cells) {
      tooltip.hidden = true;
      return;
    }
    tooltip.textContent = describeCell(cell);
    tooltip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - 430)}px`;
    tooltip.style.top = `${event.clientY + 14}px`;
    tooltip.hidden = false;
  });
  $('#kv-map').addEventListener('mouseleave', () => { tooltip.hidden = true; });

  // Stacked bars of prefill and decode tokens per step (newest right, scaled to the token budget),
  // the step time as a line on its own scale, preemptions as red marks on top.
  function drawSteps() {
    const e = state.payload.engine, steps = e.steps;
    const height = 210, top = 22, bottom = height - 2;  // labels and preemption marks above `top`
    const [ctx, width] = sizeCanvas($('#steps'), height);
    const count = steps.prefill.length;
    const maxTokens = Math.max(e.config.max_num_batched_tokens, ...steps.prefill.map((p, i) => p + steps.decode[i]));
    const maxSeconds = Math.max(1e-3, ...steps.seconds);
    const bar = width / Math.max(MIN_STEP_SLOTS, count), scale = (bottom - top) / maxTokens;
    const x = (i) => width - (count - i) * bar;
    const [prefill, decode, line, preempt, muted] = ['--prefill', '--decode', '--steptime', '--preempt', '--muted'].map(cssVar);
    for (let i = 0; i < count; i++) {
      const d = steps.decode[i] * scale, p = steps.prefill[i] * scale;
      ctx.fillStyle = decode;
      ctx.fillRect(x(i), bottom - d, Math.max(1, bar - 0.5), d);
      ctx.fillStyle = prefill;
      ctx.fillRect(x(i), bottom - d - p, Math.max(1, bar - 0.5), p);
      if (steps.preemptions[i]) {
        ctx.fillStyle = preempt;
        ctx.fillRect(x(i), 13, Math.max(2, bar), top - 15);
      }
    }
    ctx.strokeStyle = line;
    ctx.lineWidth = 1.25;
    ctx.beginPath();
    for (let i = 0; i < count; i++) {
      const y = bottom - (bottom - top) * steps.seconds[i] / maxSeconds;
      if (i === 0) ctx.moveTo(x(i) + bar / 2, y); else ctx.lineTo(x(i) + bar / 2, y);
    }
    ctx.stroke();
    ctx.fillStyle = muted;
    ctx.font = '11px system-ui, sans-serif';
    ctx.fillText(`${maxTokens} tokens`, 2, 10);
    const label = `${fmtSeconds(maxSeconds)} step`;
    ctx.fillText(label, width - ctx.measureText(label).width - 2, 10);
    const total = steps.seconds.reduce((a, b) => a + b, 0);
    setText('#steps-summary', count ? `last ${count} · ${fmtSeconds(total / count)} per step on average` : 'none yet');
  }

  window.addEventListener('resize', () => { if (state.payload) { drawKV(); drawSteps(); } });
  connect();
})();
