// The dashboard's only script: it refreshes the live part of the page
// (status and queues) every few seconds, and asks before the buttons
// whose form has a `data-confirm` question (a delete, the requeue of a
// running job). The pages work without it, refreshed by hand.
"use strict";

const live = document.getElementById("live");
if (live) {
  const seconds = Number(live.dataset.refresh) || 5;
  setInterval(async () => {
    try {
      // With the page's query: the order it shows (?running=newest) stays.
      const reply = await fetch("/live" + window.location.search, {cache: "no-store"});
      if (reply.ok) live.innerHTML = await reply.text();
    } catch (error) {
      // The server is away for now: the next tick tries again.
    }
  }, seconds * 1000);
}

for (const form of document.querySelectorAll("form[data-confirm]")) {
  form.addEventListener("submit", (event) => {
    if (!window.confirm(form.dataset.confirm)) event.preventDefault();
  });
}
