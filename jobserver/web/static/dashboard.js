// The dashboard's own script: it refreshes the live part of the page
// (status and queues) every few seconds, shows each time in the viewer's
// time zone (the server writes UTC; hovering shows the UTC value), and
// asks before the buttons whose form has a `data-confirm` question (a
// delete, the requeue of a running job). The pages work without it,
// refreshed by hand, with times in UTC.
"use strict";

// Year first, as the server writes times, so that they sort and no one
// takes the day for the month: 2026-11-26 20:05:09 CET.
const localFormat = new Intl.DateTimeFormat(undefined, {
  year: "numeric", month: "2-digit", day: "2-digit",
  hour: "2-digit", minute: "2-digit", second: "2-digit",
  hourCycle: "h23", timeZoneName: "short",
});

function localTime(moment) {
  const part = {};
  for (const {type, value} of localFormat.formatToParts(moment)) part[type] = value;
  return `${part.year}-${part.month}-${part.day} ${part.hour}:${part.minute}:${part.second} ${part.timeZoneName}`;
}

function localiseTimes(root) {
  for (const element of root.querySelectorAll("time[datetime]")) {
    const moment = new Date(element.dateTime);
    if (!Number.isNaN(moment.getTime())) element.textContent = localTime(moment);
  }
}

localiseTimes(document);

const live = document.getElementById("live");
if (live) {
  const seconds = Number(live.dataset.refresh) || 5;
  setInterval(async () => {
    try {
      // With the page's query: the order it shows (?running=newest) stays.
      const reply = await fetch("/live" + window.location.search, {cache: "no-store"});
      if (reply.ok) {
        live.innerHTML = await reply.text();
        localiseTimes(live);
      }
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
