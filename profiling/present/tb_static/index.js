// shardline TensorBoard plugin frontend: plain ES module, no framework, no network beyond this plugin's routes.
// TensorBoard loads it in the plugin iframe and calls render(). Every number shown is a value of the window
// JSON written by shardline.profiling.present.tensorboard (the breakdown and its companions), converted ns -> ms.

const BASE = new URL('./', import.meta.url);  // .../data/plugin/shardline/
const COLORS = {
  compute: '#4e79a7', all_reduce: '#e15759', all_gather: '#f28e2b', reduce_scatter: '#edc948',
  all_to_all: '#b07aa1', broadcast: '#ff9da7', barrier: '#9c755f', other_comm: '#bab0ac',
  memcpy_h2d: '#76b7b2', memcpy_d2h: '#59a14f', memcpy_d2d: '#8cd17d', memset: '#b6992d',
  bubble: '#d37295', p2p_send: '#a0cbe8', p2p_recv: '#ffbe7d', sync: '#86bcb6', idle: '#e0e0e0',
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === 'style') node.style.cssText = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

const ms = (ns) => {  // three decimals; short spans (synthetic or tiny steps) keep three significant digits
  const value = ns / 1e6;
  return value === 0 || Math.abs(value) >= 1 ? value.toFixed(3) : value.toPrecision(3);
};
const pct = (x) => (x === null || x === undefined || Number.isNaN(x) ? '' : (100 * x).toFixed(1) + '%');

async function getJSON(route, params = {}) {
  const url = new URL(route, BASE);
  for (const [k, v] of Object.entries(params)) url.searchParams.set(k, v);
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${route}: HTTP ${response.status}`);
  return response.json();
}

function routeURL(route, params) {
  const url = new URL(route, BASE);
  for (const [k, v] of Object.entries(params)) url.searchParams.set(k, v);
  return url;
}

function table(headers, rows, role) {
  return el('table', {'data-role': role},
    el('thead', {}, el('tr', {}, ...headers.map((h) => el('th', {}, h)))),
    el('tbody', {}, ...rows));
}

function stackedBars(data) {
  const rows = data.breakdown;
  const labels = data.exclusive_columns.filter((c) => rows.some((r) => r[c] !== 0));
  const longest = Math.max(...rows.map((r) => r.step_ns), 1);
  const legend = el('div', {class: 'legend'}, ...labels.map((l) =>
    el('span', {}, el('i', {style: `background:${COLORS[l] || '#999'}`}), l)));
  const bars = rows.map((r) => el('div', {class: 'bar-row', 'data-role': 'breakdown-row'},
    el('span', {class: 'bar-label'}, `rank ${r.rank} · step ${r.step}`),
    el('span', {class: 'bar', style: `width:${(100 * r.step_ns / longest).toFixed(2)}%`},
      ...labels.filter((l) => r[l] > 0).map((l) => el('i', {
        style: `width:${(100 * r[l] / r.step_ns).toFixed(3)}%;background:${COLORS[l] || '#999'}`,
        title: `${l}: ${ms(r[l])} ms`}))),
    el('span', {class: 'bar-total'}, `${ms(r.step_ns)} ms`)));
  const body = rows.map((r) => el('tr', {},
    el('td', {}, r.rank), el('td', {}, r.step), el('td', {}, ms(r.step_ns)),
    ...labels.map((l) => el('td', {}, ms(r[l]))), el('td', {}, pct(r.overlap_ratio))));
  return el('section', {},
    el('h3', {}, 'Step time by part (exclusive; communication = exposed time)'), legend, ...bars,
    table(['rank', 'step', 'step ms', ...labels.map((l) => `${l} ms`), 'overlap'], body, 'breakdown-table'));
}

function waitTransfer(data) {
  const rows = data.wait_transfer;
  if (!rows.length) return el('section', {}, el('h3', {}, 'Collectives'), el('p', {}, 'No matched collectives.'));
  const body = rows.map((r) => {
    const total = r.wait_ns + r.transfer_ns;
    return el('tr', {'data-role': 'collective-row'},
      el('td', {}, r.rank), el('td', {}, r.step), el('td', {}, r.category), el('td', {}, r.calls),
      el('td', {}, ms(r.wait_ns)), el('td', {}, ms(r.transfer_ns)),
      el('td', {}, el('span', {class: 'split'},
        el('i', {class: 'wait', style: `width:${total ? (100 * r.wait_ns / total).toFixed(1) : 0}%`}),
        el('i', {class: 'transfer', style: `width:${total ? (100 * r.transfer_ns / total).toFixed(1) : 0}%`}))));
  });
  return el('section', {}, el('h3', {}, 'Collectives: waiting for the last rank vs transfer'),
    table(['rank', 'step', 'collective', 'calls', 'wait ms', 'transfer ms', 'wait | transfer'], body, 'wait-table'));
}

function bubbles(data) {
  const rows = data.bubbles;
  if (!rows.length) {
    return el('section', {}, el('h3', {}, 'Pipeline bubbles'),
      el('p', {}, 'No pipeline annotations in this window (pp = 1).'));
  }
  const body = rows.map((r) => el('tr', {'data-role': 'bubble-row'},
    el('td', {}, r.rank), el('td', {}, r.step), el('td', {}, r.stage), el('td', {}, r.schedule),
    el('td', {}, r.p), el('td', {}, r.m), el('td', {}, ms(r.bubble_ns)), el('td', {}, pct(r.bubble_fraction)),
    el('td', {}, pct(r.ideal_fraction)),
    el('td', {}, el('span', {class: 'gauge'},
      el('i', {class: 'measured', style: `width:${(100 * (r.bubble_fraction || 0)).toFixed(1)}%`}),
      el('b', {class: 'ideal', style: `left:${(100 * (r.ideal_fraction || 0)).toFixed(1)}%`})))));
  return el('section', {}, el('h3', {}, 'Pipeline bubbles vs the ideal (p-1)/(m+p-1)'),
    table(['rank', 'step', 'stage', 'schedule', 'p', 'm', 'bubble ms', 'measured', 'ideal', ''], body,
      'bubble-table'));
}

function traceViewer(state, window) {
  const section = el('section', {'data-role': 'traces'}, el('h3', {}, 'Traces'));
  const frameHolder = el('div', {class: 'viewer'});
  for (const trace of window.traces) {
    const url = routeURL('trace', {run: state.run, window: window.name, index: trace.index});
    const download = el('a', {href: url.href, download: trace.file.replace(/\.gz$/, ''), class: 'download'},
      'download');
    const open = el('button', {'data-role': 'open-trace', onclick: () => openTrace(state, frameHolder, url)},
      'open in viewer');
    section.append(el('div', {class: 'trace-row'}, el('b', {}, trace.label), ` (${trace.kind}) `,
      state.viewer.available ? open : '', ' ', download));
  }
  if (!state.viewer.available) {
    section.append(el('div', {class: 'notice', 'data-role': 'viewer-missing'},
      'The trace viewer ships with the ',
      el('a', {href: 'https://pypi.org/project/xprof/', target: '_blank', rel: 'noopener noreferrer'}, 'xprof'),
      ' package, which is not installed here. Install it with ', el('code', {}, state.viewer.install),
      ' and restart TensorBoard; meanwhile download a trace above and open it in Perfetto UI or chrome://tracing.'));
  }
  section.append(frameHolder);
  return section;
}

function openTrace(state, holder, traceURL) {
  // xprof's viewer in non-streaming mode fetches trace_data_url itself (a same-origin path).
  const viewer = routeURL('viewer/trace_viewer_index.html',
    {is_streaming: 'false', is_oss: 'true', trace_data_url: traceURL.pathname + traceURL.search});
  holder.replaceChildren(el('iframe', {src: viewer.href, 'data-role': 'viewer-frame', title: 'trace viewer'}));
}

async function showWindow(state, content) {
  const window = state.windows.find((w) => w.name === state.window);
  content.replaceChildren(el('p', {}, 'Loading…'));
  const data = await getJSON('window', {run: state.run, window: state.window});
  const views = {
    breakdown: () => [stackedBars(data), waitTransfer(data), bubbles(data)],
    traces: () => [traceViewer(state, window)],
  };
  content.replaceChildren(...views[state.view]());
  document.body.dataset.ready = state.view;
}

export async function render() {
  document.head.append(el('link', {rel: 'stylesheet', href: new URL('static/style.css', BASE).href}));
  const root = el('div', {class: 'shardline'});
  document.body.append(root);
  let listing;
  try {
    listing = await getJSON('runs');
  } catch (error) {
    root.append(el('p', {class: 'notice'}, `Could not list the profiled runs: ${error.message}`));
    return;
  }
  const runs = Object.keys(listing.runs).filter((r) => listing.runs[r].length);
  if (!runs.length) {
    root.append(el('p', {class: 'notice'}, 'No shardline profile in this log directory. Write one with ' +
      'shardline.plugins.StepProfiler or `shardline profile report <traces> --format tensorboard -o <logdir>`.'));
    document.body.dataset.ready = 'empty';
    return;
  }
  const state = {run: runs[0], view: 'breakdown', viewer: listing.viewer};
  state.windows = listing.runs[state.run];
  state.window = state.windows[0].name;
  const content = el('div', {class: 'content'});
  const windowSelect = el('select', {'data-role': 'window-select'});
  const fillWindows = () => windowSelect.replaceChildren(...state.windows.map((w) =>
    el('option', {value: w.name}, `${w.name} (first step ${w.first_step})`)));
  fillWindows();
  const refresh = () => showWindow(state, content).catch((error) =>
    content.replaceChildren(el('p', {class: 'notice'}, error.message)));
  const runSelect = el('select', {'data-role': 'run-select', onchange: (e) => {
    state.run = e.target.value; state.windows = listing.runs[state.run]; state.window = state.windows[0].name;
    fillWindows(); refresh();
  }}, ...runs.map((r) => el('option', {value: r}, r)));
  windowSelect.addEventListener('change', (e) => { state.window = e.target.value; refresh(); });
  const tab = (view, label) => el('button', {class: 'tab', 'data-view': view, onclick: () => {
    state.view = view; refresh();
  }}, label);
  root.append(el('header', {}, el('b', {}, 'shardline'), ' run ', runSelect, ' window ', windowSelect,
    tab('breakdown', 'Step-time breakdown'), tab('traces', 'Trace viewer')), content);
  await refresh();
}
