// The token map follows the live end while a reply streams, unless the user has scrolled up:
// each refresh replaces the map's HTML, so the wish (follow or stay) is kept on its container.
(() => {
  const NEAR_END_PX = 24;
  document.addEventListener("scroll", (event) => {
    const map = event.target;
    if (!(map instanceof Element) || !map.classList.contains("token-map")) return;
    const box = map.closest("#token-map");
    if (!box || map.dataset.placing) return;
    box.dataset.follow = map.scrollHeight - map.scrollTop - map.clientHeight < NEAR_END_PX ? "1" : "0";
    box.dataset.scroll = String(map.scrollTop);
  }, true);
  const place = () => {
    const box = document.getElementById("token-map");
    const map = box && box.querySelector(".token-map");
    if (!map || map.dataset.placed) return;
    map.dataset.placed = "1";
    map.dataset.placing = "1";
    map.scrollTop = box.dataset.follow === "0" ? Number(box.dataset.scroll || 0) : map.scrollHeight;
    requestAnimationFrame(() => { delete map.dataset.placing; });
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
