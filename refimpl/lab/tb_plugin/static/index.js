// The rank-timeline page. TensorBoard imports this module in an iframe and calls render();
// standalone.js does the same for index.html. Every URL below is relative: the data routes and
// plotly.min.js come from this plugin, on this host. Nothing here computes a statistic: the
// numbers come from refimpl.profiling through the plugin's JSON routes.

const q = (id) => document.getElementById(id);
const ms = (us) => us / 1000;
const pct = (x) => (100 * x).toFixed(1) + '%';
const OP_COLORS = ['#E45756', '#B279A2', '#9D755D', '#FF9DA6', '#72B7B2', '#EECA3B', '#BAB0AC'];

const PAGE = `
  <header>
    <h1>Rank timeline</h1>
    <label>Run <select id="run"></select></label>
    <label>Steps <input id="first" type="number"> to <input id="last" type="number"></label>
    <button id="earlier" title="previous steps">&#9664;</button>
    <button id="later" title="next steps">&#9654;</button>
    <a id="merged">merged trace for Perfetto</a>
    <span id="status"></span>
  </header>
  <section>
    <h2>Timeline</h2>
    <p class="note">One lane per rank on a shared clock. <b>compute</b>: the phases;
      <b>comm</b>: time the calling thread spends in a collective; <b>backend</b>: the backend's
      own collective work (for an asynchronous collective it runs while the caller computes).
      Grey is a step with nothing labelled running: idle.</p>
    <div id="timeline" class="plot"></div>
  </section>
  <section>
    <h2>Where each step went</h2>
    <div id="steps" class="plot"></div>
    <table id="ranks"></table>
  </section>
  <section>
    <h2>Communication</h2>
    <table id="comm"></table>
  </section>
  <section>
    <h2>Memory per rank</h2>
    <p id="memory-note" class="note"></p>
    <div id="memory" class="plot"></div>
  </section>`;

async function getJSON(route, params) {
  const url = route + '?' + new URLSearchParams(params).toString();
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function loadScript(src) {
  if (window.Plotly) return Promise.resolve();
  return new Promise((resolve, reject) => {
    const s = document.createElement('script');
    s.src = src;
    s.onload = resolve;
    s.onerror = () => reject(new Error('could not load ' + src));
    document.head.append(s);
  });
}

function fmtBytes(n) {
  if (n == null) return '';
  const units = ['B', 'KB', 'MB', 'GB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return n.toFixed(i ? 1 : 0) + ' ' + units[i];
}

function fillTable(table, columns, rows) {
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  for (const [title] of columns) {
    head.append(Object.assign(document.createElement('th'), {textContent: title}));
  }
  const body = table.createTBody();
  for (const row of rows) {
    const tr = body.insertRow();
    for (const [, cell] of columns) tr.insertCell().textContent = cell(row);
  }
}

// --- the timeline: one horizontal bar per range, rows = rank x {compute, comm, backend} ---------

function laneName(rank, row) { return `rank ${rank} · ${row}`; }

function timelineFigure(data) {
  const rowsPresent = new Set(data.spans.map((s) => s.row));
  const kinds = ['compute', 'comm', 'backend', 'gpu', 'gpu comm']
    .filter((r) => rowsPresent.has(r) || r === 'compute');
  const lanes = data.ranks.flatMap((r) => kinds.map((k) => laneName(r, k)));
  const opColor = {};
  const colorOf = (s) => {
    if (s.category !== 'comm') return data.colors[s.category] || '#888';
    const op = s.op.replace(/_/g, '');   // c10d's "allreduce_" and our "all_reduce" are one op
    if (!(op in opColor)) {
      opColor[op] = op === 'allreduce' ? data.colors.comm
        : OP_COLORS[1 + (Object.keys(opColor).length % (OP_COLORS.length - 1))];
    }
    return opColor[op];
  };
  const groups = new Map();   // legend entry -> spans
  const add = (key, span, lane) => {
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push([span, lane]);
  };
  for (const s of data.spans) {
    if (s.row === 'step') {   // the step as background on every row of its rank: gaps show idle
      for (const k of kinds) add('idle (in a step)', s, laneName(s.rank, k));
    } else {
      // kernels: one legend entry per CPU label that launched them, not one per kernel name
      const gpuKey = () => `${s.row}: ${s.label || 'unlabelled'}`;
      add(s.row === 'compute' ? s.name : (s.row === 'comm' ? s.op
        : (s.row.startsWith('gpu') ? gpuKey() : s.name)), s, laneName(s.rank, s.row));
    }
  }
  const traces = [];
  for (const [key, items] of groups) {
    const first = items[0][0];
    const isStep = first.row === 'step';
    traces.push({
      type: 'bar', orientation: 'h', name: key, width: isStep ? 0.9 : 0.7,
      y: items.map(([, lane]) => lane),
      base: items.map(([s]) => ms(s.start_us)),
      x: items.map(([s]) => ms(s.dur_us)),
      customdata: items.map(([s]) => [s.name, s.step, fmtBytes(s.bytes)]),
      hovertemplate: '%{customdata[0]}<br>step %{customdata[1]}<br>%{base:.3f} ms + ' +
        '%{x:.3f} ms<br>%{customdata[2]}<extra></extra>',
      marker: {color: isStep ? data.colors.idle : colorOf(first),
               opacity: first.row === 'backend' ? 0.6 : 1, line: {width: 0}},
    });
  }
  traces.sort((a, b) => (b.name.startsWith('idle') ? 1 : 0) - (a.name.startsWith('idle') ? 1 : 0));
  const layout = {
    barmode: 'overlay', height: 110 + 24 * lanes.length, margin: {l: 140, r: 20, t: 40, b: 40},
    xaxis: {title: {text: 'ms since the run\'s first labelled event'}, zeroline: false},
    yaxis: {type: 'category', categoryorder: 'array', categoryarray: lanes, autorange: 'reversed'},
    legend: {orientation: 'h', x: 0, y: 1.02, yanchor: 'bottom'}, hovermode: 'closest',
  };
  return [traces, layout];
}

// --- the breakdown: stacked time per (step, rank) ----------------------------------------------

function stepsFigure(data, colors) {
  const parts = [['compute', colors.forward], ['overlap', '#8E6C8A'], ['comm', colors.comm],
                 ['idle', colors.idle]];
  const x = [data.per_step.map((r) => 'step ' + r.step),      // a two-level axis: step, then rank
             data.per_step.map((r) => 'rank ' + r.rank)];
  const traces = parts.map(([part, color]) => ({
    type: 'bar', name: part, x, y: data.per_step.map((r) => ms(r[part + '_us'])),
    marker: {color}, hovertemplate: `${part}: %{y:.3f} ms<extra></extra>`,
  }));
  const layout = {
    barmode: 'stack', height: 320, margin: {l: 60, r: 20, t: 40, b: 60},
    yaxis: {title: {text: 'ms'}},
    legend: {orientation: 'h', x: 0, y: 1.02, yanchor: 'bottom', traceorder: 'normal'},
  };
  return [traces, layout];
}

function memoryFigure(data) {
  const cats = [['params', '#4C78A8'], ['grads', '#F58518'], ['optimizer', '#54A24B'],
                ['activations_peak', '#B279A2']];
  const traces = cats.map(([c, color]) => ({
    type: 'bar', name: c, x: data.ranks.map((m) => 'rank ' + m.rank),
    y: data.ranks.map((m) => m[c] / 2 ** 20), marker: {color},
    hovertemplate: `${c}: %{y:.2f} MiB<extra></extra>`,
  }));
  const layout = {barmode: 'stack', height: 300, margin: {l: 60, r: 20, t: 10, b: 40},
                  yaxis: {title: {text: 'MiB'}}};
  return [traces, layout];
}

// --- wiring -------------------------------------------------------------------------------------

async function draw(state) {
  const t0 = performance.now();
  document.body.dataset.state = 'loading';
  q('status').textContent = 'loading…';
  const params = {run: state.run};
  if (state.first != null) params.steps = `${state.first}:${state.last}`;
  const [tl, bd, comm, mem] = await Promise.all([
    getJSON('timeline', params), getJSON('breakdown', params), getJSON('comm', params),
    getJSON('memory', {run: state.run})]);
  [state.first, state.last] = tl.window;
  state.steps = tl.steps;
  q('first').value = state.first;
  q('last').value = state.last;
  q('merged').href = 'merged?' + new URLSearchParams({run: state.run}).toString();
  q('merged').download = state.run.replaceAll('/', '_') + '.merged.trace.json';

  const config = {displaylogo: false, responsive: true};
  await Plotly.react(q('timeline'), ...timelineFigure(tl), config);
  await Plotly.react(q('steps'), ...stepsFigure(bd, tl.colors), config);
  fillTable(q('ranks'), [
    ['rank', (r) => r.rank], ['steps', (r) => r.steps],
    ['time (ms)', (r) => ms(r.step_us).toFixed(2)],
    ['compute', (r) => pct(r.compute_frac)], ['comm', (r) => pct(r.comm_frac)],
    ['overlap', (r) => pct(r.overlap_frac)], ['idle', (r) => pct(r.idle_frac)],
    ['comm hidden', (r) => pct(r.comm_hidden_frac)]], bd.per_rank);
  fillTable(q('comm'), [
    ['op', (r) => r.op], ['rank', (r) => r.rank], ['count', (r) => r.count],
    ['bytes', (r) => fmtBytes(r.bytes)], ['time (ms)', (r) => ms(r.time_us).toFixed(3)],
    ['GB/s', (r) => (r.GB_per_s == null ? '' : r.GB_per_s.toFixed(3))]], comm.rows);
  if (mem.ranks.length) {
    q('memory-note').textContent = '';
    await Plotly.react(q('memory'), ...memoryFigure(mem), config);
  } else {
    Plotly.purge(q('memory'));
    q('memory-note').textContent =
      'No run_summary.json in this run: the training loop writes one when it profiles.';
  }
  const n = tl.steps.length;
  q('status').textContent = `${tl.ranks.length} ranks, steps ${state.first}–${state.last} of ` +
    `${n} profiled · ${tl.spans.length} ranges · ` +
    `drawn in ${((performance.now() - t0) / 1000).toFixed(2)} s`;
  document.body.dataset.state = 'ready';
}

function shift(state, direction) {
  const size = state.last - state.first + 1;
  const lo = state.steps[0];
  const hi = state.steps[state.steps.length - 1];
  state.first = Math.min(Math.max(lo, state.first + direction * size), Math.max(lo, hi - size + 1));
  state.last = state.first + size - 1;
}

export async function render() {
  const style = Object.assign(document.createElement('link'), {rel: 'stylesheet'});
  style.href = 'style.css';
  document.head.append(style);
  document.body.innerHTML = PAGE;
  const state = {run: null, first: null, last: null, steps: []};
  const redraw = () => draw(state).catch((e) => {
    document.body.dataset.state = 'error';
    q('status').textContent = 'error: ' + e.message;
  });
  try {
    await loadScript('plotly.min.js');
    const {runs} = await getJSON('runs', {});
    if (!runs.length) {
      q('status').textContent = 'No run with rank*.pt.trace.json files under the logdir yet.';
      document.body.dataset.state = 'empty';
      return;
    }
    for (const r of runs) q('run').append(new Option(`${r.run} (${r.ranks} ranks)`, r.run));
    // index.html?run=<run> opens that run (a link from a notebook or the README can name one).
    const asked = new URLSearchParams(window.location.search).get('run');
    state.run = runs.some((r) => r.run === asked) ? asked : runs[0].run;
    q('run').value = state.run;
  } catch (e) {
    document.body.dataset.state = 'error';
    q('status').textContent = 'error: ' + e.message;
    return;
  }
  q('run').onchange = () => {
    state.run = q('run').value;
    state.first = state.last = null;   // a new run opens on its first window
    redraw();
  };
  const typed = () => { state.first = +q('first').value; state.last = +q('last').value; redraw(); };
  q('first').onchange = typed;
  q('last').onchange = typed;
  q('earlier').onclick = () => { shift(state, -1); redraw(); };
  q('later').onclick = () => { shift(state, +1); redraw(); };
  await redraw();
}
