(() => {
  if (window.__ssdTip) return; window.__ssdTip = true;
  const tip = document.createElement('div'); tip.className = 'ssd-tip'; tip.setAttribute('role', 'tooltip');
  const place = (e) => { const r = e.getBoundingClientRect(); const w = tip.offsetWidth, h = tip.offsetHeight;
    let x = Math.min(Math.max(8, r.left + r.width / 2 - w / 2), window.innerWidth - w - 8);
    let y = r.top - h - 8; if (y < 8) y = r.bottom + 8; tip.style.left = x + 'px'; tip.style.top = y + 'px'; };
  document.addEventListener('mouseover', (ev) => {
    const el = ev.target.closest && ev.target.closest('[data-tip]'); if (!el) { tip.style.display = 'none'; return; }
    if (!tip.isConnected) document.body.appendChild(tip);
    tip.textContent = el.getAttribute('data-tip'); tip.style.display = 'block'; place(el); });
  document.addEventListener('scroll', () => { tip.style.display = 'none'; }, true);
  // keep the newest streamed tokens in view (the box is re-rendered on every step)
  new MutationObserver(() => { document.querySelectorAll('.token-stream').forEach((el) => {
    if (el.dataset.seen !== '1') { el.dataset.seen = '1'; el.scrollTop = el.scrollHeight; } }); })
    .observe(document.documentElement, { childList: true, subtree: true });
})();
