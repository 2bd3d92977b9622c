// The token map follows the live end while a reply streams, unless the user has scrolled up:
// each refresh replaces the map's HTML, so the wish (follow or stay) is kept on its container.
(() => {
  const NEAR_END_PX = 24;
  document.addEventListener("scroll", (event) => {
    const map = event.target;
    if (!(map instanceof Element) || !map.classList.contains("token-map")) return;
    const box = map.closest("#token-map");
    if (!box) return;
    // the scroll that place() made is not a wish; any other is, even one in the same frame (a
    // guard until the next frame dropped the user's scrolls while a loaded machine drew slowly)
    if (String(map.scrollTop) === map.dataset.placedAt) return;
    delete map.dataset.placedAt;
    box.dataset.follow = map.scrollHeight - map.scrollTop - map.clientHeight < NEAR_END_PX ? "1" : "0";
    box.dataset.scroll = String(map.scrollTop);
  }, true);
  const place = () => {
    const box = document.getElementById("token-map");
    const map = box && box.querySelector(".token-map");
    if (!map || map.dataset.placed) return;
    map.dataset.placed = "1";
    map.scrollTop = box.dataset.follow === "0" ? Number(box.dataset.scroll || 0) : map.scrollHeight;
    map.dataset.placedAt = String(map.scrollTop);
  };
  new MutationObserver(place).observe(document.documentElement, { childList: true, subtree: true });
})();

// Enter in the message box: remember exactly what was in it when Enter went down, so that the
// send (ui_chat.SEND_JS) takes that text and leaves anything typed a moment later in the box.
document.addEventListener("keydown", (event) => {
  const box = event.target;
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  if (!(box instanceof HTMLTextAreaElement) || !box.closest("#message")) return;
  box.dataset.sent = box.value;
}, true);

// A message on its way: SEND_JS keeps it in sessionStorage, with the number of user messages the
// chat showed, until the chat shows one more. If the page loads again first (a server restart:
// Gradio reloads the page when the app it talks to is a new one) and the chat it draws has no more
// user messages than then, the message was never taken: it goes back into the box, to send again.
(() => {
  const KEY = "h2o-unsent";
  let loaded = false;
  const check = () => {
    const unsent = JSON.parse(sessionStorage.getItem(KEY) || "null");
    const taken = unsent !== null && document.querySelectorAll("#chat .user-row").length > unsent.users;
    if (loaded) {
      if (taken) sessionStorage.removeItem(KEY);
      return;
    }
    // the page's load event fills the stats, and the chat with them
    const stats = (document.querySelector("#stats") || {}).innerText || "";
    const box = document.querySelector("#message textarea");
    if (!box || !(stats.includes("Send a message") || stats.includes("tokens seen"))) return;
    loaded = true;
    if (unsent === null) return;
    if (!taken && !box.value) {
      box.value = unsent.text;
      box.dispatchEvent(new Event("input", { bubbles: true }));
    }
    sessionStorage.removeItem(KEY);
  };
  new MutationObserver(check).observe(document.documentElement, { childList: true, subtree: true });
})();

// Pins as state. The server lists the pinned messages in #chat-marks (ui_chat.marks_html); each
// message's flag is then named for what it does, its menu offers only Pin or Unpin, as the
// message is, and a pinned message carries a mark (the token map's pinned colour, app.css).
(() => {
  const PIN = "Pin (never evict)";
  const mark = () => {
    const data = document.querySelector("#chat-marks .chat-marks");
    if (!data) return;
    const pinned = new Set((data.dataset.pinned || "").split(" ").filter(Boolean).map(Number));
    const buttons = document.querySelectorAll("#chat .message-buttons");  // one after each message, in order
    document.querySelectorAll("#chat .message-row").forEach((row, i) => {
      const on = pinned.has(i);
      if (row.classList.contains("pinned") !== on) row.classList.toggle("pinned", on);
      const flag = buttons[i] && buttons[i].querySelector(".extra-feedback > button");
      const title = on ? "Pinned: never evicted (open for Unpin)" : "Pin: never evict this message";
      if (flag && flag.title !== title) {
        flag.title = title;
        flag.setAttribute("aria-label", on ? "Pinned" : "Pin");
      }
      (buttons[i] ? buttons[i].querySelectorAll(".extra-feedback-option") : []).forEach((option) => {
        const hide = (option.textContent.trim() === PIN) === on;
        if (option.hidden !== hide) option.hidden = hide;
      });
    });
  };
  new MutationObserver(mark).observe(document.documentElement, { childList: true, subtree: true });
})();
