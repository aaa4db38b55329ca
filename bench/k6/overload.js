// k6 overload test: ramps streaming chat requests through the gateway past what the engines
// can serve, and checks the gateway stays correct (no 5xx from the gateway itself, every
// stream ends with [DONE] or a clean error). Run with bench/k6.sh (starts engine-sims and
// the gateway) or against any gateway:
//   k6 run -e URL=http://127.0.0.1:8080 -e MODEL=qwen3-0.6b bench/k6/overload.js
import http from 'k6/http';
import { check } from 'k6';
import { Counter, Trend } from 'k6/metrics';

const URL = __ENV.URL || 'http://127.0.0.1:8080';
const MODEL = __ENV.MODEL || 'qwen3-0.6b';
const PEAK = parseInt(__ENV.PEAK || '200');
const ttfb = new Trend('ttfb_ms', true);
const truncated = new Counter('truncated_streams');

export const options = {
  scenarios: {
    ramp: {
      executor: 'ramping-vus',
      startVUs: 1,
      stages: [
        { duration: __ENV.RAMP || '20s', target: PEAK },
        { duration: __ENV.HOLD || '20s', target: PEAK },
        { duration: '5s', target: 0 },
      ],
    },
  },
  thresholds: {
    'checks': ['rate>0.99'],
  },
};

const system = 'You are a helpful assistant. '.repeat(40);

export default function () {
  const body = JSON.stringify({
    model: MODEL,
    stream: true,
    max_tokens: 32,
    messages: [
      { role: 'system', content: system },
      { role: 'user', content: `question ${__VU}-${__ITER}` },
    ],
  });
  const r = http.post(`${URL}/v1/chat/completions`, body, {
    headers: { 'content-type': 'application/json', 'x-session-id': `vu-${__VU}` },
    timeout: '120s',
  });
  ttfb.add(r.timings.waiting);
  const ok = check(r, {
    'status 200': (x) => x.status === 200,
    'stream complete': (x) => typeof x.body === 'string' && x.body.includes('data: [DONE]'),
    'routed': (x) => x.headers['X-Tokengate-Instance'] !== undefined,
  });
  if (r.status === 200 && !(r.body || '').includes('data: [DONE]')) {
    truncated.add(1);
  }
}
