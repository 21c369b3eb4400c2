// Drives a running nudge-console in Debian's Chromium through playwright-core (no browser is
// downloaded: NUDGE_TEST_CHROMIUM names the system's), as tests/e2e/tests/it/console_browser.rs
// runs it against the real binaries and a seeded ledger:
//   - the operator logs in, reads every page (each checked by axe-core: no serious or critical
//     violation), runs a redrive's dry run and then executes it;
//   - the viewer logs in with JavaScript switched off, reads the pages, is offered no action, and
//     a POST of their own session (with its CSRF token) is refused with 403;
//   - a screenshot of each page goes to NUDGE_CONSOLE_SCREENSHOTS.
// Prints one JSON line with what it saw (pages, their load times, violations, the redrive) and
// exits 1 at the first check that fails, naming it.
//
// Environment: NUDGE_CONSOLE_URL, NUDGE_CONSOLE_OPERATOR_TOKEN, NUDGE_CONSOLE_VIEWER_TOKEN,
// NUDGE_CONSOLE_TRACE_ID (a dead-lettered delivery), NUDGE_CONSOLE_TENANT (a tenant's name),
// NUDGE_CONSOLE_SCREENSHOTS (a directory), NUDGE_TEST_CHROMIUM (default /usr/bin/chromium).
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';
import { AxeBuilder } from '@axe-core/playwright';

function need(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
}

const base = need('NUDGE_CONSOLE_URL');
const operatorToken = need('NUDGE_CONSOLE_OPERATOR_TOKEN');
const viewerToken = need('NUDGE_CONSOLE_VIEWER_TOKEN');
const traceId = need('NUDGE_CONSOLE_TRACE_ID');
const tenant = need('NUDGE_CONSOLE_TENANT');
const shots = need('NUDGE_CONSOLE_SCREENSHOTS');
const executablePath = process.env.NUDGE_TEST_CHROMIUM || '/usr/bin/chromium';
mkdirSync(shots, { recursive: true });

function check(condition, what) {
  if (!condition) throw new Error(`check failed: ${what}`);
}

const seen = { pages: [], redrive: null, viewer: null };

// Every page an on-call engineer reads, with a text it must show.
const pages = [
  { name: 'overview', path: '/', shows: 'Rate buckets' },
  { name: 'tenants', path: '/tenants', shows: tenant },
  { name: 'dead-letters', path: '/dead-letters', shows: 'http_400' },
  // The viewer reads it after the operator's redrive started: its reason shows.
  { name: 'redrives', path: '/redrives', shows: 'New redrive', viewerShows: 'provider fixed: browser test' },
  { name: 'trace', path: `/trace?id=${encodeURIComponent(traceId)}`, shows: 'dead_lettered' },
  { name: 'audit', path: '/audit', shows: 'console_token_create' },
];

async function accessible(page, name) {
  const result = await new AxeBuilder({ page }).analyze();
  const serious = result.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical');
  const all = result.violations.map((v) => `${v.id} (${v.impact})`);
  check(
    serious.length === 0,
    `${name}: axe-core found serious violations: ${serious.map((v) => `${v.id}: ${v.help}`).join('; ')}`,
  );
  return all;
}

async function login(page, token) {
  await page.goto(`${base}/`);
  check(new URL(page.url()).pathname === '/login', `not logged in, / sends to /login (at ${page.url()})`);
  await page.fill('#token', token);
  await Promise.all([page.waitForURL(`${base}/`), page.click('form.login button[type=submit]')]);
}

const browser = await chromium.launch({ executablePath, headless: true, args: ['--no-sandbox'] });
try {
  // ---- the operator, with JavaScript (axe-core runs in the page) ------------------------------
  const operator = await browser.newContext({ viewport: { width: 1366, height: 900 } });
  const page = await operator.newPage();
  await page.goto(`${base}/login`);
  seen.pages.push({ name: 'login', violations: await accessible(page, 'login') });
  await page.screenshot({ path: join(shots, 'login.png'), fullPage: true });
  await login(page, operatorToken);
  for (const p of pages) {
    const started = Date.now();
    const answer = await page.goto(`${base}${p.path}`);
    const ms = Date.now() - started;
    check(answer.status() === 200, `${p.name}: status ${answer.status()}`);
    check((await page.content()).includes(p.shows), `${p.name} shows ${p.shows}`);
    const violations = await accessible(page, p.name);
    await page.screenshot({ path: join(shots, `${p.name}.png`), fullPage: true });
    seen.pages.push({ name: p.name, ms, violations });
  }

  // A redrive: dry run, then execute.
  await page.goto(`${base}/redrives`);
  await page.selectOption('#r-channel', 'sms');
  await page.fill('#r-rate', '2');
  await Promise.all([page.waitForURL(`${base}/redrives/plan`), page.click('text=Dry run')]);
  const plan = await page.content();
  const eligible = /Execute: redrive (\d+) deliveries/.exec(plan);
  check(eligible !== null, 'the dry run offers to execute');
  seen.pages.push({ name: 'redrive-plan', violations: await accessible(page, 'redrive-plan') });
  await page.screenshot({ path: join(shots, 'redrive-plan.png'), fullPage: true });
  await page.fill('#x-reason', 'provider fixed: browser test');
  await page.fill('#x-incident', 'INC-BROWSER');
  await Promise.all([
    page.waitForURL((url) => url.pathname === '/redrives' && url.searchParams.has('notice')),
    page.click('text=Execute: redrive'),
  ]);
  const started = await page.textContent('p.notice');
  check(/Redrive \d+ started: \d+ deliveries/.test(started), `the redrive started (${started})`);
  check((await page.content()).includes('<progress'), 'the redrive shows its progress');
  await page.screenshot({ path: join(shots, 'redrives-running.png'), fullPage: true });
  seen.redrive = { planned: Number(eligible[1]), notice: started };
  await operator.close();

  // ---- the viewer, without JavaScript ----------------------------------------------------------
  const viewer = await browser.newContext({ javaScriptEnabled: false, viewport: { width: 1366, height: 900 } });
  const vpage = await viewer.newPage();
  await login(vpage, viewerToken);
  for (const p of pages) {
    const answer = await vpage.goto(`${base}${p.path}`);
    check(answer.status() === 200, `viewer ${p.name}: status ${answer.status()}`);
    const html = await vpage.content();
    const shows = p.viewerShows ?? p.shows;
    check(html.includes(shows), `viewer ${p.name} shows ${shows}`);
    for (const action of ['Dry run', 'Pause intake', 'Resume intake', 'Drain</button>', 'End drain', 'Set rate', 'Resume now', 'Execute', 'Pause</button>', 'Cancel</button>']) {
      const at = html.indexOf(action);
      check(at < 0, `viewer ${p.name} is offered no "${action}": ${html.slice(Math.max(0, at - 300), at + 50)}`);
    }
  }
  const csrf = await vpage.getAttribute('input[name=csrf]', 'value');
  const refused = await vpage.request.post(`${base}/channels/sms/drain`, {
    form: { csrf, draining: 'true', reason: 'a viewer trying' },
    maxRedirects: 0,
  });
  check(refused.status() === 403, `a viewer's POST is refused with 403 (got ${refused.status()})`);
  seen.viewer = { post_status: refused.status() };
  await viewer.close();
} finally {
  await browser.close();
}
console.log(JSON.stringify(seen));
