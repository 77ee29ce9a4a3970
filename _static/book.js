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
