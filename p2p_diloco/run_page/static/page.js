// The run's page: every data-refresh-s seconds, <main> is replaced by the server's /main, which is
// HTML the server built with every peer-supplied string escaped. Nothing else runs here.
(function () {
  "use strict";
  var seconds = Number(document.body.getAttribute("data-refresh-s")) || 10;
  function refresh() {
    fetch("main", {cache: "no-store"}).then(function (response) {
      if (!response.ok) { throw new Error(response.status); }
      return response.text();
    }).then(function (text) {
      document.getElementById("main").innerHTML = text;
      document.body.classList.remove("stale");
    }).catch(function () {
      document.body.classList.add("stale");  // the server is gone or failing: the page says so
    }).then(function () {
      setTimeout(refresh, seconds * 1000);
    });
  }
  setTimeout(refresh, seconds * 1000);
})();
