// Calls to the API of the server or proxy that served the page. When a call is refused for want of
// an API key, the page's key form asks for one (once: it is kept in localStorage) and the call is
// sent again with it. Errors come back as ApiError with the server's own message.

const KEY_ITEM = "tandem-api-key";
let keyAsked = null;  // one promise while the form is shown, so concurrent calls ask only once

export class ApiError extends Error {}

function withKey(headers = {}) {
  const key = localStorage.getItem(KEY_ITEM);
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

function askForKey() {
  keyAsked ??= new Promise((resolve) => {
    const form = document.getElementById("key-form");
    const input = document.getElementById("api-key");
    form.hidden = false;
    input.focus();
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_ITEM, input.value.trim());
      input.value = "";
      form.hidden = true;
      keyAsked = null;
      resolve();
    }, { once: true });
  });
  return keyAsked;
}

async function messageOf(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status} ${response.statusText}`;
  }
}

export async function call(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: withKey(options.headers) });
    if (response.status === 401) {
      localStorage.removeItem(KEY_ITEM);
      await askForKey();
      continue;
    }
    if (!response.ok) throw new ApiError(await messageOf(response));
    return response;
  }
}

export async function getJson(path) {
  return (await call(path)).json();
}

export function post(path, body, signal) {
  return call(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal });
}

// The payloads of an SSE response, parsed as JSON, up to `[DONE]`. Read through fetch rather than
// EventSource, which cannot send the Authorization header.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

export function showError(error) {
  const box = document.getElementById("error");
  box.textContent = error ? String(error.message ?? error) : "";
  box.hidden = !error;
}

// An element with text: always textContent, so no text from a model or a server becomes markup.
export function element(tag, text = "", className = "") {
  const node = document.createElement(tag);
  node.textContent = text;
  if (className) node.className = className;
  return node;
}
