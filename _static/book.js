// The landing page's architecture diagram (intro.md): a box links to its chapter as soon as that
// chapter is in the table of contents, _toc.yml (the sidebar lists exactly those pages), so a
// chapter that is not published yet is never a broken link.
document.addEventListener("DOMContentLoaded", () => {
  const published = new Set(
    Array.from(document.querySelectorAll("nav.bd-docs-nav a.reference.internal"), (a) => a.pathname),
  );
  for (const box of document.querySelectorAll("svg.arch a[data-chapter]")) {
    const target = `${box.dataset.chapter}.html`;
    if (published.has(new URL(target, document.baseURI).pathname)) {
      box.setAttribute("href", target);
    }
  }
});

// A figure drawn wider than the text column is shown shrunk: click it (or Enter) to see it at
// full size over the page; a click anywhere or Escape closes it.
window.addEventListener("load", () => {
  for (const img of document.querySelectorAll(".bd-content div.cell_output img")) {
    if (img.naturalWidth > 1.15 * img.clientWidth) {
      img.classList.add("book-zoomable");
      img.title = "Click to enlarge";
      img.tabIndex = 0;
      img.setAttribute("role", "button");
      img.addEventListener("click", () => enlarge(img));
      img.addEventListener("keydown", (event) => event.key === "Enter" && enlarge(img));
    }
  }
});

function enlarge(img) {
  const overlay = document.createElement("div");
  overlay.className = "book-zoom";
  const big = document.createElement("img");
  big.className = "book-zoom-image";
  big.src = img.currentSrc || img.src;
  big.alt = img.alt;
  overlay.append(big);
  const close = () => {
    overlay.remove();
    document.removeEventListener("keydown", onKey);
    img.focus();
  };
  const onKey = (event) => event.key === "Escape" && close();
  overlay.addEventListener("click", close);
  document.addEventListener("keydown", onKey);
  document.body.append(overlay);
}

// sphinx-book-theme 1.3 and pydata-sphinx-theme 0.17 give a click handler only to the first
// .primary-toggle / .secondary-toggle of a page: the one in pydata's header bar, which book.css
// hides. The buttons readers see, in the article header, pass their click on to it, so that they
// collapse the sidebar on a wide screen and open it as a drawer on a small one.
document.addEventListener("DOMContentLoaded", () => {
  for (const selector of [".primary-toggle", ".secondary-toggle"]) {
    const [handled, ...others] = document.querySelectorAll(selector);
    for (const button of others) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        handled.click();
      });
    }
  }
});
