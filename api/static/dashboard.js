// The vlmcap dashboard: live captions, camera counters, engine charts and a chat box, all read from this
// server's own API. Captions, camera names and model answers are untrusted text: they only ever reach the
// page through textContent (this file never uses innerHTML).
"use strict";

const KEY_STORAGE = "vlmcap.apiKey";
const FEED_LIMIT = 100; // caption cards kept on the page
const CHART_POINTS = 120; // two minutes at one point a second
const ENGINE_POLL_MS = 1000;
const CAMERAS_POLL_MS = 2000;
const THUMBNAIL_WIDTH = 352;
const STRIP_WIDTH = 120; // px of each frame in an event's strip
const CHAT_MAX_TOKENS = 256;
const RATE_NAMES = ["captured", "skipped", "dropped", "detected", "enqueued"];

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function formatTime(unixSeconds) {
  if (!unixSeconds) return "";
  const date = new Date(unixSeconds * 1000);
  const sameDay = date.toDateString() === new Date().toDateString();
  return sameDay ? date.toLocaleTimeString() : date.toLocaleString();
}

function formatNumber(value, digits = 1) {
  if (value === null || value === undefined) return "–";
  return Number(value).toFixed(Math.abs(value) >= 100 ? 0 : digits);
}

// -- the API key and every request ---------------------------------------------------------------------

class Unauthorized extends Error {}
class ServerDown extends Error {}
class ServerLoading extends Error {}

const auth = {
  key: sessionStorage.getItem(KEY_STORAGE),
  waiting: [],

  headers() {
    return this.key ? { Authorization: `Bearer ${this.key}` } : {};
  },

  // Resolves once the user has entered a key (after a 401); every refused loop waits on it.
  nextKey() {
    openKeyDialog();
    return new Promise((resolve) => this.waiting.push(resolve));
  },

  save(key) {
    this.key = key;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("change-key").hidden = false;
    for (const resolve of this.waiting.splice(0)) resolve();
  },
};

function openKeyDialog() {
  const dialog = $("key-dialog");
  if (dialog.open) return;
  $("key-message").textContent = auth.key
    ? "The server refused this API key. Enter the right one."
    : "This server needs an API key.";
  $("key-input").value = "";
  dialog.showModal();
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// fetch() with the key; throws Unauthorized (401), ServerLoading (503), ServerDown (no answer) or Error.
// A 401 to a request sent with a key the user has replaced since is tried again with the new key (else a
// poll that left with the wrong key would reopen the key dialog right after the right key was entered).
async function api(path, options = {}) {
  let response;
  let sentKey;
  do {
    sentKey = auth.key;
    try {
      response = await fetch(path, { ...options, headers: { ...auth.headers(), ...(options.headers || {}) } });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ServerDown("The vlmcap server cannot be reached.");
    }
  } while (response.status === 401 && auth.key !== sentKey);
  if (response.status === 401) throw new Unauthorized(await errorMessage(response));
  if (response.status === 503) throw new ServerLoading(await errorMessage(response));
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

// -- connection state: the banner and the header pill ------------------------------------------------------

const problems = new Map(); // loop name -> message

function showProblem(source, err, retrySeconds) {
  const retry = retrySeconds ? ` Retrying in ${retrySeconds} s…` : "";
  const text = err instanceof ServerLoading ? `The server is not ready: ${err.message}.${retry}`
    : err instanceof ServerDown ? `${err.message}${retry}` : `Error: ${err.message}${retry}`;
  problems.set(source, { text, kind: err instanceof ServerLoading ? "loading" : "down" });
  renderConnection();
}

function clearProblem(source) {
  if (problems.delete(source)) renderConnection();
}

function renderConnection() {
  const banner = $("banner");
  const first = problems.values().next().value;
  banner.hidden = !first;
  if (first) {
    banner.textContent = first.text;
    banner.dataset.kind = first.kind;
  }
}

function setFeedState(state) {
  const pill = $("connection");
  pill.dataset.state = state;
  pill.textContent = { live: "live", offline: "offline", connecting: "connecting" }[state];
}

// Runs `step` forever: after a success waits `periodMs`; after a failure shows it and backs off (1 s,
// 2 s, 4 s, … 30 s); after a 401 waits for a key.
async function keepRunning(source, step, periodMs) {
  let failures = 0;
  for (;;) {
    try {
      await step();
      failures = 0;
      clearProblem(source);
      await sleep(periodMs);
    } catch (err) {
      if (err instanceof Unauthorized) {
        await auth.nextKey();
        continue;
      }
      const delay = Math.min(30, 2 ** failures);
      failures += 1;
      showProblem(source, err, delay);
      await sleep(delay * 1000);
    }
  }
}

// Server-sent events from a fetch() response (EventSource cannot send the Authorization header).
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r/g, "");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { type: "message", id: null, data: [] };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data.push(text);
        else if (field === "event") event.type = text;
        else if (field === "id") event.id = text;
      }
      if (event.data.length) onEvent({ ...event, data: event.data.join("\n") });
    }
  }
}

// -- frames ------------------------------------------------------------------------------------------------

// At most a few frame requests at once: a page of fifty captions must not start fifty JPEG renders.
const frameQueue = { running: 0, waiting: [] };

async function withFrameSlot(task) {
  while (frameQueue.running >= 4) await new Promise((resolve) => frameQueue.waiting.push(resolve));
  frameQueue.running += 1;
  try {
    return await task();
  } finally {
    frameQueue.running -= 1;
    frameQueue.waiting.shift()?.();
  }
}

// An object URL of the caption's frame with its boxes drawn, or null when it has none (REST captions,
// expired frames).
async function frameUrl(captionId, maxWidth, frame = 0, boxes = true) {
  const params = new URLSearchParams();
  if (maxWidth) params.set("max_width", maxWidth);
  if (frame) params.set("frame", frame);
  if (!boxes) params.set("boxes", "false"); // an event's frames show their person's box drawn and labelled
  const query = params.size ? `?${params}` : "";
  try {
    const response = await withFrameSlot(() => api(`v1/captions/${encodeURIComponent(captionId)}/image${query}`));
    return URL.createObjectURL(await response.blob());
  } catch {
    return null; // a missing frame shows as such; a server problem shows in the banner
  }
}

async function openFrame(result) {
  const dialog = $("frame-dialog");
  const image = $("frame-image");
  if (image.src) URL.revokeObjectURL(image.src);
  image.removeAttribute("src");
  $("frame-meta").replaceChildren(...captionMeta(result));
  fillCaptionText($("frame-caption"), result);
  $("frame-structured").replaceChildren(...[structuredFields(result)].filter(Boolean));
  dialog.showModal();
  const url = await frameUrl(result.id, null);
  if (url) image.src = url;
  else image.alt = "This caption has no frame (REST captions keep none; camera frames expire after some hours).";
}

// -- the caption feed ----------------------------------------------------------------------------------------

const feed = { camera: "", lastEventId: null, controller: null, cards: new Map() };
const knownCameras = new Set();

function peopleLabel(count) {
  return count === 1 ? "1 person" : `${count} people`;
}

function captionMeta(result) {
  const parts = [el("span", "camera-badge", result.camera_id || "upload"),
    el("time", "time", formatTime(result.created_at)), el("span", "people", peopleLabel(result.person_count))];
  if (result.status === "failed") parts.push(el("span", "badge-failed", "failed"));
  if (result.fall) parts.push(el("span", "badge-fall", "fall"));
  else if (result.kind) parts.push(el("span", `badge-kind kind-${result.kind}`, result.kind));
  if (result.frame_count > 1) {
    const who = result.track_id !== null && result.track_id !== undefined ? `person ${result.track_id} · ` : "";
    parts.push(el("span", "muted small", `${who}${(result.end_ts - result.start_ts).toFixed(1)} s · `
      + `${result.frame_count} frames`));
  }
  return parts;
}

// An event's (or a fall's lead-up) frames in time order, each as a small image.
function frameStrip(result) {
  const strip = el("div", "frame-strip");
  for (let index = 0; index < result.frame_count; index += 1) {
    const cell = el("div", "strip-frame", "…");
    strip.append(cell);
    frameUrl(result.id, STRIP_WIDTH, index, false).then((url) => {
      if (!url) return void (cell.textContent = "—");
      const image = el("img");
      image.alt = `Frame ${index + 1} of ${result.frame_count}`;
      image.src = url;
      cell.replaceChildren(image);
    });
  }
  return strip;
}

function fillCaptionText(node, result) {
  const failed = result.status === "failed";
  node.textContent = failed ? result.error || "failed" : result.caption || "";
  node.classList.toggle("error", failed);
}

// A structured caption (a job or upload with a JSON schema): its fields as a definition list, each value as
// text (a list of objects shows one line per item), or null for a plain caption.
function structuredFields(result) {
  if (!result.structured || typeof result.structured !== "object") return null;
  const list = el("dl", "structured");
  const show = (value) => (value !== null && typeof value === "object" ? JSON.stringify(value) : String(value));
  for (const [name, value] of Object.entries(result.structured)) {
    const values = Array.isArray(value) && value.length && value.every((v) => v && typeof v === "object")
      ? value.map((item) => Object.values(item).map(show).join(" · "))
      : [Array.isArray(value) ? value.map(show).join(", ") : show(value)];
    list.append(el("dt", null, name.replaceAll("_", " ")), ...values.map((v) => el("dd", null, v)));
  }
  return list;
}

function rememberCamera(cameraId) {
  if (!cameraId || knownCameras.has(cameraId)) return;
  knownCameras.add(cameraId);
  const option = el("option", null, cameraId);
  option.value = cameraId;
  const select = $("camera-filter");
  const after = [...select.options].slice(1).find((o) => o.value.localeCompare(cameraId) > 0);
  select.insertBefore(option, after || null);
}

function captionCard(result) {
  const card = el("li", result.fall ? "caption-card fall" : "caption-card");
  card.tabIndex = 0;
  card.dataset.id = result.id;
  const thumb = el("div", "thumb", "…");
  const body = el("div", "caption-body");
  const meta = el("div", "meta");
  meta.append(...captionMeta(result));
  const text = el("p", "caption-text");
  fillCaptionText(text, result);
  body.append(meta, text, ...[structuredFields(result)].filter(Boolean));
  if (result.frame_count > 1) body.append(frameStrip(result));
  card.append(thumb, body);
  card.addEventListener("click", () => openFrame(result));
  card.addEventListener("keydown", (event) => { if (event.key === "Enter") openFrame(result); });
  frameUrl(result.id, THUMBNAIL_WIDTH).then((url) => {
    if (!url) {
      thumb.textContent = "no frame";
      return;
    }
    const image = el("img");
    image.alt = `Frame of ${result.camera_id || "an upload"}`;
    image.src = url;
    thumb.replaceChildren(image);
  });
  return card;
}

function addCaption(result, { fresh }) {
  rememberCamera(result.camera_id);
  if (feed.cards.has(result.id) || (feed.camera && result.camera_id !== feed.camera)) return;
  const card = captionCard(result);
  feed.cards.set(result.id, card);
  const list = $("feed");
  if (fresh) {
    card.classList.add("fresh");
    list.prepend(card);
  } else {
    list.append(card);
  }
  while (list.children.length > FEED_LIMIT) {
    const last = list.lastElementChild;
    feed.cards.delete(last.dataset.id);
    const image = last.querySelector("img");
    if (image) URL.revokeObjectURL(image.src);
    last.remove();
  }
  $("feed-empty").hidden = true;
}

function clearFeed() {
  for (const image of $("feed").querySelectorAll("img")) URL.revokeObjectURL(image.src);
  $("feed").replaceChildren();
  feed.cards.clear();
  feed.lastEventId = null;
  $("feed-empty").hidden = false;
}

// One connection of the feed: the event stream (resuming after the last event seen), then, on a fresh
// start, the latest captions; returns when the server ends the stream.
async function followFeed() {
  const controller = new AbortController();
  feed.controller = controller;
  const camera = feed.camera ? `camera=${encodeURIComponent(feed.camera)}` : "";
  const headers = feed.lastEventId ? { "Last-Event-ID": feed.lastEventId } : {};
  setFeedState("connecting");
  try {
    const stream = await api(`v1/captions/stream${camera ? `?${camera}` : ""}`,
      { headers, signal: controller.signal, cache: "no-store" });
    if (!feed.lastEventId) {
      const recent = await (await api(`v1/captions?limit=50${camera ? `&${camera}` : ""}`,
        { signal: controller.signal })).json();
      for (const result of recent.data) addCaption(result, { fresh: false });
    }
    setFeedState("live");
    clearProblem("feed");
    await readEvents(stream, (event) => {
      if (event.type !== "caption") return;
      feed.lastEventId = event.id;
      addCaption(JSON.parse(event.data), { fresh: true });
    });
  } catch (err) {
    if (controller.signal.aborted) return; // the camera filter changed: start over
    setFeedState("offline");
    // A stream cut mid-read rejects with a TypeError, like a fetch that found no server.
    throw err instanceof TypeError ? new ServerDown("The connection to the vlmcap server was lost.") : err;
  }
}

// -- fall alerts: the newest one in a strip above the page -------------------------------------------------
// Polled, not streamed: a browser opens at most six connections to one server, and the caption feed already
// holds one open; a second endless stream left the chat waiting behind the thumbnails.

const alerts = { shownId: null };
const RECENT_ALERT_S = 600; // a fall alert newer than this shows when the page finds it
const ALERTS_POLL_MS = 2000;

function showAlert(result) {
  const text = `${result.camera_id || "a camera"}, ${formatTime(result.created_at)}: ` +
    (result.status === "failed" ? "a person on the ground (no caption)" : result.caption || "");
  $("alert-text").textContent = text;
  $("alert").hidden = false;
  $("alert").onclick = (event) => { if (event.target.id !== "alert-dismiss") openFrame(result); };
}

async function refreshAlerts() {
  const newest = (await (await api("v1/alerts?limit=1", { cache: "no-store" })).json()).data[0];
  if (!newest || newest.id === alerts.shownId) return;
  alerts.shownId = newest.id;
  if (Date.now() / 1000 - (newest.finished_at || 0) < RECENT_ALERT_S) showAlert(newest);
}

function filterFeed(camera) {
  feed.camera = camera;
  clearFeed();
  feed.controller?.abort();
}

// -- cameras -------------------------------------------------------------------------------------------------

function cameraCard(camera) {
  const card = el("div", "camera");
  const head = el("div", "camera-head");
  const dot = el("span", "dot");
  const state = camera.status === "stopped" ? "stopped" : camera.age_s > 10 ? "stale" : "live";
  dot.dataset.state = state;
  dot.title = state;
  head.append(dot, el("span", "camera-name", camera.camera_id),
    el("span", "muted small", `${camera.detector} · ${state}`));
  const rates = el("div", "rates");
  for (const name of RATE_NAMES) {
    const cell = el("div", "rate");
    cell.title = `${camera.counters[name] ?? 0} ${name} since the pipeline started`;
    cell.append(el("b", null, formatNumber(camera.rates[name])), el("span", null, `${name}/s`));
    rates.append(cell);
  }
  card.append(head, rates);
  const last = camera.last_caption;
  const lastNode = el("div", "last-caption");
  if (last) {
    const text = el("p", "caption-text");
    fillCaptionText(text, last);
    lastNode.append(el("span", "muted small", `Last caption · ${formatTime(last.created_at)}`), text);
    lastNode.addEventListener("click", () => openFrame(last));
  } else {
    lastNode.append(el("span", "muted small", "No caption yet"));
  }
  card.append(lastNode);
  const summaryNode = el("div", "camera-summary");
  card.append(summaryNode);
  api(`v1/cameras/${encodeURIComponent(camera.camera_id)}/summaries?limit=1`)
    .then((response) => response.json())
    .then(({ data }) => {
      const newest = data[0];
      if (!newest) return;
      const { title, summary, threat_level: threat } = newest.summary;
      summaryNode.append(el("span", "muted small", `Summary · ${formatTime(newest.end)} · threat ${threat}`),
        el("b", null, title), el("p", "caption-text", summary));
    })
    .catch(() => {});
  return card;
}

async function refreshCameras() {
  const cameras = (await (await api("v1/cameras")).json()).data;
  for (const camera of cameras) rememberCamera(camera.camera_id);
  $("cameras").replaceChildren(...cameras.map(cameraCard));
  $("cameras-empty").hidden = cameras.length > 0;
}

// -- engine charts -------------------------------------------------------------------------------------------

const engineHistory = { running: [], waiting: [], kv: [], stepMean: [], stepMax: [], budget: [], throughput: [],
  p50: [], p99: [], prefix: [] };

function record(name, value) {
  const values = engineHistory[name];
  values.push(value);
  if (values.length > CHART_POINTS) values.shift();
}

// Lines of `series` ([values, css colour variable, dashed?]) on a canvas, scaled to `top` or the largest value.
function drawChart(canvas, series, top) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const context = canvas.getContext("2d");
  context.scale(ratio, ratio);
  context.clearRect(0, 0, width, height);
  const values = series.flatMap(([points]) => points.filter((v) => v !== null));
  const max = top ?? Math.max(1e-9, ...values) * 1.15;
  const styles = getComputedStyle(document.documentElement);
  context.strokeStyle = styles.getPropertyValue("--border");
  context.lineWidth = 1;
  context.beginPath();
  context.moveTo(0, height - 0.5);
  context.lineTo(width, height - 0.5);
  context.stroke();
  const step = width / (CHART_POINTS - 1);
  for (const [points, colour, dashed] of series) {
    context.strokeStyle = styles.getPropertyValue(colour);
    context.lineWidth = 1.5;
    context.setLineDash(dashed ? [4, 3] : []);
    context.beginPath();
    let drawing = false;
    points.forEach((value, index) => {
      if (value === null) {
        drawing = false;
        return;
      }
      const x = (CHART_POINTS - points.length + index) * step;
      const y = height - 2 - (Math.min(value, max) / max) * (height - 4);
      if (drawing) context.lineTo(x, y);
      else context.moveTo(x, y);
      drawing = true;
    });
    context.stroke();
  }
}

function chartCanvas(id) {
  return $(id).querySelector("canvas");
}

function drawEngineCharts() {
  drawChart(chartCanvas("chart-requests"), [[engineHistory.running, "--c1"], [engineHistory.waiting, "--c2"]]);
  drawChart(chartCanvas("chart-kv"), [[engineHistory.kv, "--c1"]], 100);
  drawChart(chartCanvas("chart-step"),
    [[engineHistory.budget, "--c3", true], [engineHistory.stepMax, "--c2"], [engineHistory.stepMean, "--c1"]]);
  drawChart(chartCanvas("chart-throughput"), [[engineHistory.throughput, "--c1"]]);
  drawChart(chartCanvas("chart-prefix"), [[engineHistory.prefix, "--c1"]], 100);
  drawChart(chartCanvas("chart-itl"), [[engineHistory.p50, "--c1"], [engineHistory.p99, "--c2"]]);
}

async function refreshEngine() {
  const stats = await (await api("v1/engine/stats")).json();
  $("model").textContent = `model: ${stats.model}`;
  record("running", stats.running);
  record("waiting", stats.waiting);
  record("kv", stats.kv_cache_usage * 100);
  record("stepMean", stats.step_tokens_mean);
  record("stepMax", stats.step_tokens_max);
  record("budget", stats.step_token_budget);
  record("throughput", stats.output_tokens_per_s);
  record("p50", stats.itl_p50_ms);
  record("p99", stats.itl_p99_ms);
  record("prefix", stats.prefix_cache_hit_rate * 100);
  $("engine-requests").textContent = `${stats.running} running · ${stats.waiting} waiting`;
  $("engine-kv").textContent = `${formatNumber(stats.kv_cache_usage * 100)} % · ${stats.kv_blocks_used}/${stats.kv_blocks_total} blocks`;
  $("engine-step").textContent = `${formatNumber(stats.step_tokens_mean)} / ${stats.step_token_budget}`;
  $("engine-throughput").textContent = formatNumber(stats.output_tokens_per_s);
  $("engine-prefix").textContent = `${formatNumber(stats.prefix_cache_hit_rate * 100)} % · ` +
    `${stats.prefix_cache_hit_tokens} tokens · ${stats.encoder_cache_hits} images or tiles reused`;
  $("engine-itl").textContent = stats.itl_samples
    ? `p50 ${formatNumber(stats.itl_p50_ms)} ms · p99 ${formatNumber(stats.itl_p99_ms)} ms`
    : "no tokens in the last minute";
  const jobs = stats.camera_jobs;  // the in-process queue worker's: running, and claimed waiting for a slot
  $("engine-note").textContent = `${stats.steps_per_s.toFixed(1)} steps/s · ${stats.num_preemptions} preemptions` +
    (jobs ? ` · camera jobs: ${jobs.running} running, ${jobs.claimed} claimed` : "");
  drawEngineCharts();
}

// -- chat ----------------------------------------------------------------------------------------------------

// The image to send: a data URL for the request, an object URL to show it (the page's CSP allows blob:
// images only). Object URLs of sent images live as long as their chat bubbles.
const chat = { model: null, image: null, shownImages: [], messages: [], busy: false };

function setChatImage(image) {
  if (chat.image && !chat.shownImages.includes(chat.image.url)) URL.revokeObjectURL(chat.image.url);
  chat.image = image;
  const preview = $("chat-preview");
  preview.hidden = !image;
  if (image) preview.src = image.url;
  else preview.removeAttribute("src");
  $("chat-remove-image").hidden = !image;
}

function readImageFile(file) {
  if (!file || !file.type.startsWith("image/")) return;
  const reader = new FileReader();
  reader.addEventListener("load", () => setChatImage({ dataUrl: reader.result, url: URL.createObjectURL(file) }));
  reader.readAsDataURL(file);
}

function chatBubble(role, text, image) {
  const log = $("chat-log");
  log.querySelector(".empty")?.remove();
  const bubble = el("div", `message ${role}`);
  if (image) {
    const preview = el("img");
    preview.alt = "Image sent";
    preview.src = image;
    bubble.append(preview);
  }
  const body = el("div", "text", text);
  const status = el("div", "status");
  bubble.append(body, status);
  log.append(bubble);
  log.scrollTop = log.scrollHeight;
  return { bubble, body, status };
}

async function modelId() {
  if (!chat.model) chat.model = (await (await api("v1/models")).json()).data[0].id;
  return chat.model;
}

async function sendChat(event) {
  event.preventDefault();
  const input = $("chat-input");
  const text = input.value.trim();
  if (chat.busy || (!text && !chat.image)) return;
  const content = [];
  if (chat.image) {
    content.push({ type: "image_url", image_url: { url: chat.image.dataUrl } });
    chat.shownImages.push(chat.image.url);
  }
  content.push({ type: "text", text: text || "Describe this image." });
  chatBubble("user", text || "Describe this image.", chat.image?.url);
  chat.messages.push({ role: "user", content });
  input.value = "";
  setChatImage(null);
  chat.busy = true;
  $("chat-send").disabled = true;
  const answer = chatBubble("assistant", "");
  answer.bubble.dataset.state = "streaming";
  answer.status.textContent = "thinking…";
  let reply = "";
  let chunks = 0;
  const started = performance.now();
  try {
    for (;;) {
      try {
        const response = await api("v1/chat/completions", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ model: await modelId(), messages: chat.messages, stream: true,
            stream_options: { include_usage: true }, max_tokens: CHAT_MAX_TOKENS }),
        });
        let usage = null;
        await readEvents(response, (sse) => {
          if (sse.data === "[DONE]") return;
          const chunk = JSON.parse(sse.data);
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices?.[0]?.delta?.content;
          if (delta) {
            reply += delta;
            chunks += 1;
            answer.body.textContent = reply;
            answer.status.textContent = "streaming…";
            $("chat-log").scrollTop = $("chat-log").scrollHeight;
          }
          if (chunk.usage) usage = chunk.usage;
        });
        const seconds = (performance.now() - started) / 1000;
        answer.status.textContent = usage
          ? `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s`
          : `done in ${seconds.toFixed(1)} s`;
        answer.bubble.dataset.chunks = String(chunks);
        answer.bubble.dataset.state = "done";
        chat.messages.push({ role: "assistant", content: reply });
        return;
      } catch (err) {
        if (!(err instanceof Unauthorized)) throw err;
        await auth.nextKey();
      }
    }
  } catch (err) {
    chat.messages.pop(); // the question that got no answer
    answer.bubble.classList.add("error");
    answer.bubble.dataset.state = "failed";
    answer.body.textContent = reply;
    answer.status.textContent = err instanceof ServerDown || err instanceof ServerLoading
      ? `${err.message} Try again in a moment.` : `Error: ${err.message}`;
  } finally {
    chat.busy = false;
    $("chat-send").disabled = false;
  }
}

function resetChat() {
  chat.messages = [];
  for (const url of chat.shownImages.splice(0)) URL.revokeObjectURL(url);
  $("chat-log").replaceChildren(el("p", "empty", "Ask the model about an image: drop one below or choose a file."));
}

// -- start -----------------------------------------------------------------------------------------------------

// -- the camera memory: event search and the event page --------------------------------------------------
// GET /v1/events (words, falls only, a cursor for more), an event's page in a dialog (its frames, caption,
// similar events and its camera's timeline), opened by a result or by the address's #event=<id>.

const EVENTS_PAGE = 20;
const events = { query: null, cursor: null, urls: [] };

// An object URL of one of an event's kept frames, or null.
async function eventFrameUrl(eventId, index) {
  try {
    const path = `v1/events/${encodeURIComponent(eventId)}/frames/${index}`;
    return URL.createObjectURL(await (await withFrameSlot(() => api(path))).blob());
  } catch {
    return null;
  }
}

// Shows the event's first frame in `thumb` once loaded ("—" if it cannot be), its object URL kept in `urls` to be
// revoked with the list; false for an event that kept no frame.
function showFirstFrame(thumb, event, urls) {
  if (!event.frame_count) return false;
  eventFrameUrl(event.id, 0).then((url) => {
    if (!url) return void (thumb.textContent = "—");
    urls.push(url);
    const image = el("img");
    image.alt = `First frame of event ${event.id}`;
    image.src = url;
    thumb.replaceChildren(image);
  });
  return true;
}

function eventMeta(event) {
  const parts = [el("span", "camera-badge", event.camera_id), el("time", "time", formatTime(event.start_ts))];
  if (event.fall) parts.push(el("span", "badge-fall", "fall"));
  else parts.push(el("span", `badge-kind kind-${event.kind}`, event.kind));
  if (event.track_id !== null && event.track_id !== undefined) {
    parts.push(el("span", "muted small", `person ${event.track_id}`));
  }
  if (event.score !== undefined) parts.push(el("span", "muted small score", `score ${formatNumber(event.score, 3)}`));
  return parts;
}

// One event in a list: its first frame, its meta and caption; a click opens its page.
function eventItem(event, current) {
  const item = el("li", current ? "event-item current" : "event-item");
  item.dataset.id = event.id;
  rememberCamera(event.camera_id);
  item.tabIndex = 0;
  const thumb = el("div", "event-thumb", "…");
  const body = el("div", "caption-body");
  const meta = el("div", "meta");
  meta.append(...eventMeta(event));
  body.append(meta, el("p", "caption-text", event.caption));
  item.append(thumb, body);
  item.addEventListener("click", () => openEvent(event.id));
  item.addEventListener("keydown", (key) => { if (key.key === "Enter") openEvent(event.id); });
  if (!showFirstFrame(thumb, event, events.urls)) thumb.textContent = "no frame";
  return item;
}

async function searchEvents(more = false) {
  if (!more) {
    const params = new URLSearchParams({ limit: EVENTS_PAGE });
    const q = $("events-q").value.trim();
    if (q) params.set("q", q);
    if ($("events-fall").checked) params.set("fall", "true");
    events.query = params;
    events.cursor = null;
    $("events").replaceChildren();
  }
  const params = new URLSearchParams(events.query);
  if (more && events.cursor) params.set("cursor", events.cursor);
  $("events-note").textContent = "searching…";
  try {
    const page = await (await api(`v1/events?${params}`, { cache: "no-store" })).json();
    $("events").append(...page.data.map((event) => eventItem(event, false)));
    events.cursor = page.next_cursor;
    $("events-more").hidden = !page.has_more;
    $("events-empty").hidden = $("events").children.length > 0;
    $("events-note").textContent = "";
  } catch (err) {
    $("events-note").textContent = err.message;
    if (err instanceof Unauthorized) { // searched again once a key is entered
      await auth.nextKey();
      await searchEvents(more);
    }
  }
}

async function openEvent(eventId) {
  const dialog = $("event-dialog");
  for (const url of events.urls.splice(0)) URL.revokeObjectURL(url);
  for (const id of ["event-meta", "event-frames", "event-structured", "event-similar", "event-timeline"]) {
    $(id).replaceChildren();
  }
  $("event-caption").textContent = "";
  if (!dialog.open) dialog.showModal();
  history.replaceState(null, "", `#event=${encodeURIComponent(eventId)}`);
  let event;
  try {
    event = await (await api(`v1/events/${encodeURIComponent(eventId)}`)).json();
  } catch (err) {
    $("event-caption").textContent = `This event cannot be shown: ${err.message}`;
    return;
  }
  dialog.dataset.id = event.id;
  $("event-title").textContent = `${event.kind === "fall" ? "Fall" : "Event"} at ${event.camera_id}`;
  $("event-meta").append(...eventMeta(event),
    el("span", "muted small", `${(event.end_ts - event.start_ts).toFixed(1)} s · ${event.frame_count} frames`));
  $("event-caption").textContent = event.caption;
  $("event-structured").replaceChildren(...[structuredFields(event)].filter(Boolean));
  $("event-camera").textContent = event.camera_id;
  for (const frame of event.frames) {
    const cell = el("div", "strip-frame", "…");
    $("event-frames").append(cell);
    eventFrameUrl(event.id, frame.index).then((url) => {
      if (!url) return void (cell.textContent = "—");
      events.urls.push(url);
      const image = el("img");
      image.alt = `Frame ${frame.index + 1} of ${event.frame_count}, ${formatTime(frame.ts)}`;
      image.src = url;
      cell.replaceChildren(image);
    });
  }
  const fill = async (listId, path) => {
    try {
      const found = (await (await api(path, { cache: "no-store" })).json()).data;
      $(listId).replaceChildren(...found.map((other) => eventItem(other, other.id === event.id)));
      if (!found.length) $(listId).append(el("li", "empty", "none"));
    } catch (err) {
      $(listId).replaceChildren(el("li", "empty", err.message));
    }
  };
  const id = encodeURIComponent(event.id);
  const around = new URLSearchParams({ camera: event.camera_id, limit: 10, until: event.end_ts + 3600,
    since: Math.max(0, event.start_ts - 3600) });
  await Promise.all([fill("event-similar", `v1/events/${id}/similar?limit=6`), fill("event-timeline", `v1/events?${around}`)]);
}

function openEventFromAddress() {
  const match = location.hash.match(/^#event=([A-Za-z0-9_.:-]{1,128})$/);
  if (match) openEvent(match[1]);
}

// -- the ask box: POST /v1/cameras/ask, streamed ------------------------------------------------------------
// The question, the camera chosen in the feed's filter and a time range; the answer's text as it streams, then
// the events the model was given (their references, first frames and captions) as links to their pages, the
// ones the answer cites marked. Model and caption text go in as text only.

const ask = { busy: false, urls: [] };

// One event the answer was given: a link to its page (#event=<id>) with its first frame, reference and caption.
function askItem(event) {
  const item = el("li", "ask-item");
  item.dataset.id = event.id;
  const link = el("a", "ask-event");
  link.href = `#event=${encodeURIComponent(event.id)}`;
  const thumb = el("div", "event-thumb", event.frame_count ? "…" : "no frame");
  const body = el("div", "caption-body");
  const meta = el("div", "meta");
  meta.append(el("span", "ask-reference", `[${event.reference}]`), ...eventMeta(event));
  body.append(meta, el("p", "caption-text", event.caption));
  link.append(thumb, body);
  item.append(link);
  showFirstFrame(thumb, event, ask.urls);
  return item;
}

function askBody() {
  const body = { question: $("ask-question").value.trim(), stream: true };
  const camera = $("camera-filter").value;
  if (camera) body.cameras = [camera];
  const range = Number($("ask-since").value);
  if (range) body.since = Date.now() / 1000 - range;
  return body;
}

async function askCameras(submitted) {
  submitted.preventDefault();
  const body = askBody();
  if (ask.busy || !body.question) return;
  ask.busy = true;
  $("ask-send").disabled = true;
  for (const url of ask.urls.splice(0)) URL.revokeObjectURL(url);
  const answer = $("ask-answer");
  const list = $("ask-events");
  answer.hidden = false;
  answer.textContent = "";
  answer.dataset.state = "streaming";
  list.replaceChildren();
  $("ask-note").textContent = "asking…";
  let text = "";
  try {
    for (;;) {
      try {
        const response = await api("v1/cameras/ask", {
          method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        });
        let cited = [];
        await readEvents(response, (sse) => {
          if (sse.data === "[DONE]") return;
          const chunk = JSON.parse(sse.data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.events) list.replaceChildren(...chunk.events.map(askItem));
          if (chunk.delta) {
            text += chunk.delta;
            answer.textContent = text;
            $("ask-note").textContent = "answering…";
          }
          if (chunk.cited_event_ids) cited = chunk.cited_event_ids;
        });
        for (const item of list.children) item.classList.toggle("cited", cited.includes(item.dataset.id));
        answer.dataset.state = "done";
        $("ask-note").textContent = list.children.length
          ? `from ${list.children.length} events, ${cited.length} cited` : "";
        return;
      } catch (err) {
        if (!(err instanceof Unauthorized)) throw err;
        await auth.nextKey();
      }
    }
  } catch (err) {
    answer.dataset.state = "failed";
    answer.textContent = text;
    $("ask-note").textContent = err instanceof ServerDown || err instanceof ServerLoading
      ? `${err.message} Try again in a moment.` : `Error: ${err.message}`;
  } finally {
    ask.busy = false;
    $("ask-send").disabled = false;
  }
}

function bindMemory() {
  $("ask-form").addEventListener("submit", askCameras);
  $("events-form").addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    searchEvents(false);
  });
  $("events-more").addEventListener("click", () => searchEvents(true));
  $("event-close").addEventListener("click", () => $("event-dialog").close());
  $("event-dialog").addEventListener("close", () => history.replaceState(null, "", location.pathname));
  window.addEventListener("hashchange", openEventFromAddress);
  searchEvents(false);
  openEventFromAddress();
}

function bindControls() {
  $("camera-filter").addEventListener("change", (event) => filterFeed(event.target.value));
  $("frame-close").addEventListener("click", () => $("frame-dialog").close());
  $("frame-dialog").addEventListener("click", (event) => {
    if (event.target === event.currentTarget) event.currentTarget.close(); // a click on the backdrop
  });
  $("key-form").addEventListener("submit", (event) => {
    const key = $("key-input").value.trim();
    if (!key) {
      event.preventDefault();
      return;
    }
    auth.save(key);
  });
  $("key-dialog").addEventListener("cancel", (event) => event.preventDefault()); // the page needs a key
  $("change-key").hidden = !auth.key;
  $("change-key").addEventListener("click", openKeyDialog);

  $("alert-dismiss").addEventListener("click", () => { $("alert").hidden = true; });
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) sendChat(event);
  });
  $("chat-file").addEventListener("change", (event) => {
    readImageFile(event.target.files[0]);
    event.target.value = "";
  });
  $("chat-remove-image").addEventListener("click", () => setChatImage(null));
  $("chat-reset").addEventListener("click", resetChat);
  const zone = $("drop-zone");
  for (const name of ["dragenter", "dragover"]) {
    zone.addEventListener(name, (event) => {
      event.preventDefault();
      zone.classList.add("over");
    });
  }
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    readImageFile(event.dataTransfer.files[0]);
  });
  window.addEventListener("resize", drawEngineCharts);
}

bindControls();
bindMemory();
keepRunning("feed", followFeed, 0);
keepRunning("alerts", refreshAlerts, ALERTS_POLL_MS);
keepRunning("cameras", refreshCameras, CAMERAS_POLL_MS);
keepRunning("engine", refreshEngine, ENGINE_POLL_MS);
