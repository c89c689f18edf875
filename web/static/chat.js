// The chat page, on the server (one model) and on the proxy (a model picker over its /v1/models,
// with each model's state and a cancel button for a load in progress). The conversation lives in
// the page; each answer streams in over /v1/chat/completions and ends with its timings line.
import { ApiError, call, element, events, getJson, post, showError } from "/static/api.js";

const $ = (id) => document.getElementById(id);
const messages = [];  // the conversation sent with each request: {role, content}
let streaming = null;  // the AbortController of the answer streaming in

function addMessage(role, text) {
  const box = element("div", "", `message ${role}`);
  box.append(element("div", role, "role"), element("div", text, "text"));
  $("history").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function timingsLine(t) {
  const rate = (x) => (x ?? 0).toFixed(1);
  const tokens = (n) => `${n} token${n === 1 ? "" : "s"}`;
  let line = `PP ${rate(t.prompt_per_second)} t/s (${tokens(t.prompt_n)}) · TG ${rate(t.predicted_per_second)} t/s (${tokens(t.predicted_n)})`;
  if (t.draft_n) line += ` · drafts accepted ${t.draft_n_accepted}/${t.draft_n}`;
  return line;
}

function settings() {
  const temperature = Number($("temperature").value);
  const maxTokens = Number($("max-tokens").value);
  const chosen = { temperature, max_tokens: maxTokens };
  const tools = $("tools").value.trim();
  if (!tools) return chosen;
  try {
    return { ...chosen, tools: JSON.parse(tools), tool_choice: $("tool-choice").value };
  } catch (error) {
    throw new ApiError(`tools: not valid JSON (${error.message})`);
  }
}

// A call streams in as its id and name, then its arguments; it shows as name(arguments).
function addToolCall(answer, calls, part) {
  const call = calls[part.index] ??= { name: "", arguments: "", box: element("div", "", "tool-call") };
  if (!call.box.isConnected) [...answer.querySelectorAll(".text, .tool-call")].at(-1).after(call.box);
  call.name += part.function?.name ?? "";
  call.arguments += part.function?.arguments ?? "";
  call.box.textContent = `called ${call.name}(${call.arguments})`;
}

async function send(text) {
  showError(null);
  messages.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const textBox = answer.querySelector(".text");
  streaming = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  // Text is added, and scrolled to, at most every 50 ms: scrolling forces a layout of the whole
  // answer, and once per token that starves the page (and its stop button) on a fast stream.
  let pending = "";
  let timer = null;
  const flush = () => {
    clearTimeout(timer);
    timer = null;
    if (!pending) return;
    textBox.append(pending);  // a text node: the model's output never becomes markup
    pending = "";
    answer.scrollIntoView({ block: "end" });
  };
  const calls = [];
  try {
    const body = { model: $("model").value, messages, stream: true, ...settings() };
    const response = await post("/v1/chat/completions", body, streaming.signal);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new ApiError(chunk.error.message);
      for (const part of chunk.choices?.[0]?.delta?.tool_calls ?? []) addToolCall(answer, calls, part);
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) {
        pending += piece;
        timer ??= setTimeout(flush, 50);
      }
      if (chunk.timings) {
        flush();
        answer.append(element("div", timingsLine(chunk.timings), "timings"));
      }
    }
  } catch (error) {
    if (error.name === "AbortError") answer.append(element("div", "stopped", "timings"));
    else showError(error);
  } finally {
    flush();
    // A turn refused before any text is left out of the conversation, so the next one is not sent it.
    const toolCalls = calls.map((c, i) => ({ id: `call_${i}`, type: "function",
                                             function: { name: c.name, arguments: c.arguments } }));
    if (textBox.textContent || toolCalls.length) {
      messages.push({ role: "assistant", content: textBox.textContent || null,
                      ...(toolCalls.length ? { tool_calls: toolCalls } : {}) });
    } else messages.pop();
    streaming = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// On the proxy each model has a status; the server has one model, always ready once it answers.
let models = [];

function showModelStatus() {
  const model = models.find((m) => m.id === $("model").value);
  const status = model?.status?.value ?? "";
  $("model-status").textContent = status;
  $("model-status").className = `status ${status}`;
  $("cancel-load").hidden = status !== "loading";
}

async function refreshModels() {
  models = (await getJson("/v1/models")).data;
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...models.map((m) => {
    const option = element("option", m.id);
    option.value = m.id;
    return option;
  }));
  if (models.some((m) => m.id === chosen)) select.value = chosen;
  const onProxy = models.some((m) => m.status);
  $("operator-link").hidden = !onProxy;
  showModelStatus();
  return onProxy;
}

async function cancelLoad() {
  const running = await getJson("/running");
  const model = running.models.find((m) => m.model === $("model").value);
  if (model?.current_job) await call(`/jobs/${model.current_job}`, { method: "DELETE" });
  await refreshModels();
}

$("compose").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || streaming) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("compose").requestSubmit();
  }
});
$("stop").addEventListener("click", () => streaming?.abort());
$("new-chat").addEventListener("click", () => {
  streaming?.abort();
  messages.length = 0;
  $("history").replaceChildren();
});
$("model").addEventListener("change", showModelStatus);
$("cancel-load").addEventListener("click", () => cancelLoad().catch(showError));

// A server still loading its model answers 503 for a while: the page says so and tries again.
async function start() {
  for (;;) {
    try {
      const onProxy = await refreshModels();
      showError(null);
      if (onProxy) setInterval(() => refreshModels().catch(showError), 2000);
      return;
    } catch (error) {
      showError(error);
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }
}

start();
