"""Reports of a finished (or running) study: collect it into plain data, then render it (HTML
with plotly, or JSON), and the optuna-dashboard front end. Reads studies; runs no trial."""
