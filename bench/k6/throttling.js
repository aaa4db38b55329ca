// Throttling under overload: a constant arrival rate of non-streaming chat requests with
// max_tokens 1 (so a request's duration is its time to first token: queueing + prefill + one
// decode step), at RATE requests/s for DURATION. Counts answers by status and records the
// duration of the admitted (200) ones. Run by bench/throttling.sh.
import http from 'k6/http';
import { Counter, Trend } from 'k6/metrics';

const URL = __ENV.URL || 'http://127.0.0.1:8080';
const MODEL = __ENV.MODEL || 'm';
const PROMPT_WORDS = parseInt(__ENV.PROMPT_WORDS || '1000');
const ttft = new Trend('ttft_ok_ms', true);
const ok = new Counter('status_200');
const rejected = new Counter('status_429');
const unavailable = new Counter('status_503');
const other = new Counter('status_other');

export const options = {
  discardResponseBodies: true,
  summaryTrendStats: ['avg', 'min', 'med', 'max', 'p(90)', 'p(95)', 'p(99)'],
  scenarios: {
    overload: {
      executor: 'constant-arrival-rate',
      rate: parseInt(__ENV.RATE || '32'),
      timeUnit: '1s',
      duration: __ENV.DURATION || '30s',
      preAllocatedVUs: 200,
      maxVUs: 2000,
    },
  },
};

export default function () {
  // Every request has its own prompt (no prefix cache hits: prefill is the work).
  const words = [];
  for (let i = 0; i < PROMPT_WORDS; i++) words.push(`w${__VU}x${__ITER}y${i}`);
  const body = JSON.stringify({
    model: MODEL,
    max_tokens: 1,
    messages: [{ role: 'user', content: words.join(' ') }],
  });
  const r = http.post(`${URL}/v1/chat/completions`, body, {
    headers: { 'content-type': 'application/json' },
    timeout: '120s',
  });
  if (r.status === 200) {
    ok.add(1);
    ttft.add(r.timings.duration);
  } else if (r.status === 429) {
    rejected.add(1);
  } else if (r.status === 503) {
    unavailable.add(1);
  } else {
    other.add(1);
  }
}
