"""The stage contract's ports: what the operator renders (container ports, Services,
NetworkPolicies, probes, the stage config's ``ports``) and what a stage listens on when its
config names none."""

#: A stage's HTTP server: vLLM's OpenAI API on an AR stage, the receiving stage's server.
HTTP_PORT = 8000
#: A stage's KV receiver (the control socket of its transfers).
KV_PORT = 9600
#: The pipeline's endpoint (the one address a client uses for the whole pipeline).
ENDPOINT_PORT = 8080
