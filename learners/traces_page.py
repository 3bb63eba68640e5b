"""The trace viewer's page (learners/traces.py fills it): inline CSS and script, nothing fetched. Its filters are the
URL hash's parameters, read on load and on every change: min and max (total reward, inclusive), answer (correct or
incorrect), stage (a stage name), open=all (every episode expanded)."""
from string import Template

PAGE = Template("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>$title</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; }
form { position: sticky; top: 0; background: #f4f4f4; padding: .5em; border: 1px solid #ccc; z-index: 1; }
form label { margin-right: 1em; } form input { width: 6em; }
h2 { border-bottom: 1px solid #ccc; margin-top: 1.5em; }
details.episode { border: 1px solid #ddd; border-radius: 4px; margin: .3em 0; padding: .2em .5em; }
details.episode > summary { cursor: pointer; }
.reward, .adv { font-family: monospace; margin-right: .5em; }
.ok { color: #17702c; font-weight: bold; } .bad { color: #b3261e; font-weight: bold; } .dim { color: #777; }
.body { margin: .5em 0 .5em 1em; } .body h4 { margin: .8em 0 .2em; }
pre { white-space: pre-wrap; background: #fafafa; border: 1px solid #eee; padding: .4em; margin: .2em 0; }
.turn { border-left: 3px solid #8ab; padding-left: .6em; margin: .4em 0; } .doc { font-family: monospace; color: #456; }
img { max-width: 320px; margin: .3em .3em 0 0; border: 1px solid #ccc; }
table { border-collapse: collapse; } td { border: 1px solid #ddd; padding: .1em .6em; font-family: monospace; }
tr.total td { font-weight: bold; }
</style></head><body>
<h1>$title</h1>
<form id="filters" onsubmit="return false">
<label>reward from <input name="min" type="number" step="any"></label>
<label>to <input name="max" type="number" step="any"></label>
<label>answer <select name="answer"><option value="">all</option><option value="correct">correct</option>
<option value="incorrect">incorrect</option></select></label>
<label>stage <select name="stage"><option value="">all</option>$stages</select></label>
<button type="button" id="expand">expand all</button> <button type="button" id="collapse">collapse all</button>
<span id="count"><span id="shown">$total</span> of $total episodes shown ($steps steps)</span>
</form>
$sections
<script>
"use strict";
const form = document.getElementById("filters");
const names = ["min", "max", "answer", "stage"];
function apply() {
  const p = new URLSearchParams(location.hash.slice(1));
  for (const n of names) form.elements[n].value = p.get(n) || "";
  const min = parseFloat(p.get("min")), max = parseFloat(p.get("max"));
  const answer = p.get("answer") || "", stage = p.get("stage") || "";
  let shown = 0;
  for (const section of document.querySelectorAll("section.step")) {
    let any = false;
    for (const ep of section.querySelectorAll("details.episode")) {
      const r = parseFloat(ep.dataset.reward);
      const keep = !(r < min) && !(r > max) && (!stage || ep.dataset.stage === stage)
        && (!answer || (answer === "correct") === (ep.dataset.correct === "1"));
      ep.hidden = !keep;
      if (p.get("open") === "all") ep.open = true;
      if (keep) { shown++; any = true; }
    }
    section.hidden = !any;
  }
  document.getElementById("shown").textContent = shown;
}
function update(extra) {
  const p = new URLSearchParams();
  for (const n of names) if (form.elements[n].value) p.set(n, form.elements[n].value);
  if (extra) p.set("open", "all");
  location.hash = p.toString();
}
form.addEventListener("change", () => update(false));
document.getElementById("expand").onclick = () => update(true);
document.getElementById("collapse").onclick = () => {
  for (const ep of document.querySelectorAll("details.episode")) ep.open = false;
  update(false);
};
window.addEventListener("hashchange", apply);
apply();
</script>
</body></html>
""")
